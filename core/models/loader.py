"""Build models from a checkpoint folder or from a random-init preset."""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import CheckpointError, load_weights, read_tensor, tensor_files, vocab_map
from .config import dflash_config, read_config_json, read_model_config
from .dflash import DFlashDraftModel
from .dialect import DFLASH_DIALECT
from .layers import Rotary, init_random
from .presets import dflash_preset, target_preset
from .shard import Shard, ShardedTarget, shard_reader
from .speculators_dflash import SPECULATORS_DFLASH
from .target import TargetModel


def load_target(folder: str | Path, shard: Shard | None = None) -> TargetModel:
    """The target in a checkpoint folder; with ``shard``, that rank's ShardedTarget, each
    tensor sliced as it is read (a rank never holds the whole target)."""
    cfg = read_model_config(folder)
    model = TargetModel(cfg) if shard is None else ShardedTarget(cfg, shard)
    tied = ("lm_head.weight",) if model.config.tie_word_embeddings else ()
    unused = load_weights(model, folder, optional=tied, read=None if shard is None else shard_reader(shard))
    scales = [n for n in unused if n.endswith("weight_scale_inv")]
    if scales:  # their weights would have loaded unscaled
        raise CheckpointError(f"{folder}: tensor(s) {', '.join(scales[:3])} scale fp8 weights, but config.json has "
                              "no quantization_config; add the checkpoint's own (quant_method fp8) or use its bf16 weights")
    return model.eval()


# Presets above this many parameters draw their random weights on the device they run on:
# drawing billions of values on the CPU takes minutes. Smaller ones draw on the CPU, so the
# same spec gives the same weights on a CPU and on a GPU.
DEVICE_INIT_PARAMS = 200_000_000


def random_target(preset: str, seed: int, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> TargetModel:
    cfg = target_preset(preset)
    return _materialize(lambda: TargetModel(cfg), seed, cfg.initializer_range, torch.device(device), dtype)


def _materialize(build, seed: int, std: float, device: torch.device, dtype: torch.dtype):
    """Build on the meta device (no default init), allocate on ``device`` in ``dtype``, fill."""
    with torch.device("meta"):
        model = build()
    params = sum(p.numel() for p in model.parameters())
    model = model.to_empty(device=device).to(dtype)
    for m in model.modules():
        if isinstance(m, Rotary):
            m.inv_freq.data = m.inv_freq.data.float()
            m.reset()
    init_random(model, seed, std, device if params > DEVICE_INIT_PARAMS else "cpu")
    return model.eval()


def load_dflash(folder: str | Path) -> DFlashDraftModel:
    model = DFlashDraftModel(dflash_config(read_config_json(folder)))
    dialect = SPECULATORS_DFLASH if model.config.dialect == SPECULATORS_DFLASH.name else DFLASH_DIALECT
    unused = set(load_weights(model, folder))
    if model.config.draft_vocab_size is not None:  # a reduced vocabulary's map to target ids
        files = tensor_files(folder)
        vocab_map(model, *(read_tensor(files, n) if n in files else None for n in ("d2t", "t2d")), folder)
        unused -= {"d2t", "t2d"}
    dialect.check_tensors(unused, folder)
    return model.eval()


def random_dflash(preset: str, seed: int, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> DFlashDraftModel:
    cfg = dflash_preset(preset)
    return _materialize(lambda: DFlashDraftModel(cfg), seed, cfg.layers.initializer_range, torch.device(device), dtype)


def place(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Move parameters to device/dtype; rotary tables stay float32 (computed per call)."""
    module.to(device=device)
    for p in module.parameters():
        p.data = p.data.to(dtype)
    return module
