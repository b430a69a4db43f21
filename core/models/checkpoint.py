"""HF-format checkpoint folders: ``config.json`` plus ``model.safetensors`` or a sharded
``model.safetensors.index.json``. Missing or mis-shaped tensors raise an error naming them."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint folder that does not hold the tensors a module needs."""


@contextmanager
def open_tensors(path: Path):
    """``safe_open`` with a damaged file's error naming the file and the fix."""
    try:
        handle = safe_open(path, framework="pt")
    except SafetensorError as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc}); it is truncated or damaged: "
                              "download or save it again") from None
    with handle as f:
        yield f


def tensor_files(folder: str | Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it."""
    folder = Path(folder)
    if (folder / INDEX).is_file():
        try:
            weight_map = json.loads((folder / INDEX).read_text()).get("weight_map", {})
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{folder / INDEX}: not valid JSON ({exc}); download or save it again") from None
        files = {name: folder / shard for name, shard in weight_map.items()}
        missing = sorted({str(p) for p in files.values() if not p.is_file()})
        if missing:
            raise CheckpointError(f"{folder / INDEX} names shard files that are missing: {missing}")
        for shard in sorted(set(files.values())):  # open each header: a damaged shard fails here, named
            with open_tensors(shard):
                pass
        return files
    if (folder / SINGLE).is_file():
        with open_tensors(folder / SINGLE) as f:
            return {name: folder / SINGLE for name in f.keys()}
    raise CheckpointError(f"{folder}: neither {SINGLE} nor {INDEX} found; is this an HF-format checkpoint folder?")


def load_weights(module: nn.Module, folder: str | Path, optional: tuple[str, ...] = (),
                 names: dict[str, str] | None = None, read=None) -> list[str]:
    """Copy every parameter of ``module`` from the folder's tensors; return the unused names.

    ``optional`` names may be absent (e.g. a tied ``lm_head.weight``). ``names`` maps a
    parameter's name to its tensor's name where a checkpoint dialect spells it otherwise.
    ``read(handle, name)`` reads a tensor from an open file (default: whole; a tensor-parallel
    shard reads its slice).
    """
    read = read or (lambda f, name: f.get_tensor(name))
    files = tensor_files(folder)
    params = {(names or {}).get(n, n): p for n, p in module.named_parameters()}
    for prefix, m in module.named_modules():  # quantized layers keep their checkpoint tensors as buffers
        for b in getattr(m, "checkpoint_buffers", ()):
            params[f"{prefix}.{b}" if prefix else b] = getattr(m, b)
    missing = [n for n in params if n not in files and n not in optional]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise CheckpointError(f"{folder}: missing tensor(s) {shown} ({len(missing)} in all)")
    by_file: dict[Path, list[str]] = {}
    for name in params:
        if name in files:
            by_file.setdefault(files[name], []).append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            with open_tensors(path) as f:
                for name in names:
                    _copy(params[name], read(f, name), name, path)
    return sorted(set(files) - set(params))


# dtypes a tensor must already have: a quantized weight and its scales are read as they are
EXACT = (torch.float8_e4m3fn,)


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str, path: Path) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise CheckpointError(
            f"{path.name}: tensor {name} has shape {list(tensor.shape)}, "
            f"the config implies {list(param.shape)}; the config.json and weights disagree"
        )
    if tensor.dtype in EXACT and param.dtype not in EXACT:
        raise CheckpointError(f"{path.name}: tensor {name} is {tensor.dtype}, but config.json has no quantization_config "
                              "(quant_method fp8); add the checkpoint's own, or use its bf16 weights")
    if (param.dtype in EXACT or name.endswith("weight_scale_inv")) and tensor.dtype != param.dtype:
        raise CheckpointError(f"{path.name}: tensor {name} is {tensor.dtype}, the config's quantization_config "
                              f"implies {param.dtype}; the config.json and weights disagree")
    param.copy_(tensor.to(param.dtype))


def save_checkpoint(folder: str | Path, config: dict[str, Any], module: nn.Module,
                    extra: dict[str, torch.Tensor] | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (tied weights stored once), with
    ``extra`` tensors (buffers a format keeps beside the weights) under their own names.
    ``dtype`` converts the weights' copies on the way out (the module keeps its own)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    seen: set[int] = set()
    tensors = {}
    for name, p in module.named_parameters():  # named_parameters skips tied duplicates
        if id(p) not in seen:
            seen.add(id(p))
            tensors[name] = p.detach().to(dtype or p.dtype).cpu().contiguous()
    tensors.update({name: t.detach().cpu().contiguous() for name, t in (extra or {}).items()})
    save_file(tensors, str(folder / SINGLE))
    return folder


def vocab_map(model: nn.Module, d2t: torch.Tensor | None, t2d: torch.Tensor | None, folder) -> None:
    """Fill a drafter's d2t [Vd] (draft id -> target id offset) and t2d [V] (target ids in the
    draft vocabulary) buffers: read, derived from each other, or the identity of a full
    vocabulary; the two must agree."""
    vd, v = model.d2t.shape[0], model.t2d.shape[0]
    if d2t is None:
        if vd != v:
            raise CheckpointError(f"{folder}: missing tensor d2t (the draft vocabulary's mapping to target ids)")
        d2t = torch.zeros(vd, dtype=torch.int64)
    if tuple(d2t.shape) != (vd,):
        raise CheckpointError(f"{folder}: d2t has shape {list(d2t.shape)}, expected {[vd]} "
                              "(draft_vocab_size and vocab_size in config.json)")
    ids = torch.arange(vd) + d2t.long()
    if bool((ids < 0).any() | (ids >= v).any()):
        raise CheckpointError(f"{folder}: d2t maps draft ids outside the target vocabulary 0..{v - 1}")
    derived = torch.zeros(v, dtype=torch.bool)
    derived[ids] = True
    if t2d is not None:
        if tuple(t2d.shape) != (v,):
            raise CheckpointError(f"{folder}: t2d has shape {list(t2d.shape)}, expected {[v]} "
                                  "(draft_vocab_size and vocab_size in config.json)")
        if not torch.equal(t2d.bool(), derived):
            raise CheckpointError(f"{folder}: t2d and d2t disagree on which target ids the draft vocabulary holds")
    with torch.no_grad():
        model.d2t.copy_(d2t)
        model.t2d.copy_(derived)


def read_tensor(files: dict[str, Path], name: str) -> torch.Tensor:
    with open_tensors(files[name]) as f:
        return f.get_tensor(name)
