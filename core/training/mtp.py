"""Frozen-KV MTP drafter training by self-distillation: chained steps over text the target
wrote (draftline.core.methods.gemma4_mtp.training_loss), run by chain.distill_chain."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from ..methods.gemma4_mtp import training_loss
from ..models.config import read_config_json
from ..models.gemma4_mtp import PRESETS, Gemma4MTPModel, load_mtp, mtp_config
from ..models.layers import init_random
from ..models.presets import lookup_preset
from ..models.target import TargetModel
from .chain import ChainTrainConfig, distill_chain
from .loop import Summary


@dataclass(frozen=True)
class MTPTrainConfig(ChainTrainConfig):
    preset: str = "tiny-code-mtp"
    chain_steps: int = 4  # chained steps trained per context end


def fixed_chain_tau(correct: Tensor) -> float:
    """τ if every context end c started a round of len(correct) drafts: correct [steps, b, T]
    (step j's agreement at c belongs to the chain started at c), bool for greedy drafts, or
    each step's chance of acceptance (sampled drafts' overlaps)."""
    steps, _, t = correct.shape
    runs = correct[:, :, : t - steps + 1].permute(1, 2, 0)  # [b, starts, steps]
    return 1.0 + float(runs.float().cumprod(dim=-1).sum(-1).mean())


def train_mtp(target: TargetModel, corpus: dict | None, out: Path, cfg: MTPTrainConfig, device,
              init: Path | None = None, resume: dict | None = None) -> Summary:
    """``corpus`` as written by build_corpus; ``init`` continues from a drafter checkpoint;
    ``resume`` (a training state from load_state, ``init`` its folder) continues that run."""
    if init is not None:
        raw, model = read_config_json(init), load_mtp(init).float()
    else:
        raw = {**lookup_preset(PRESETS, cfg.preset, "gemma4_mtp"), "vocab_size": target.config.vocab_size}
        model = Gemma4MTPModel(mtp_config(raw))
        init_random(model, cfg.seed, model.config.layers.initializer_range)
    return distill_chain("gemma4_mtp", model, raw, lambda tokens: training_loss(model, target, tokens, cfg.chain_steps),
                         fixed_chain_tau, target, corpus, out, cfg, device, resume=resume)
