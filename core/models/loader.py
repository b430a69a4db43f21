"""Build models from a checkpoint folder or from a random-init preset."""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import load_weights
from .config import dflash_config, model_config, read_config_json
from .dflash import DFlashDraftModel
from .layers import init_random
from .presets import dflash_preset, target_preset
from .target import TargetModel


def load_target(folder: str | Path) -> TargetModel:
    model = TargetModel(model_config(read_config_json(folder)))
    tied = ("lm_head.weight",) if model.config.tie_word_embeddings else ()
    load_weights(model, folder, optional=tied)
    return model.eval()


def random_target(preset: str, seed: int) -> TargetModel:
    cfg = target_preset(preset)
    model = TargetModel(cfg)
    init_random(model, seed, cfg.initializer_range)
    return model.eval()


def load_dflash(folder: str | Path) -> DFlashDraftModel:
    model = DFlashDraftModel(dflash_config(read_config_json(folder)))
    load_weights(model, folder)
    return model.eval()


def random_dflash(preset: str, seed: int) -> DFlashDraftModel:
    cfg = dflash_preset(preset)
    model = DFlashDraftModel(cfg)
    init_random(model, seed, cfg.layers.initializer_range)
    return model.eval()


def place(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Move parameters to device/dtype; rotary tables stay float32 (computed per call)."""
    module.to(device=device)
    for p in module.parameters():
        p.data = p.data.to(dtype)
    return module
