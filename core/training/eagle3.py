"""EAGLE-3 head training by self-distillation: the unrolled training-time test over text the
target wrote (draftline.core.methods.eagle3.training_loss), run by chain.distill_chain."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..methods.eagle3 import training_loss
from ..models.config import read_config_json
from ..models.eagle3 import PRESETS, Eagle3DraftModel, eagle3_config, load_eagle3
from ..models.layers import init_random
from ..models.presets import lookup_preset
from ..models.target import TargetModel
from .chain import ChainTrainConfig, distill_chain
from .loop import Summary


@dataclass(frozen=True)
class Eagle3TrainConfig(ChainTrainConfig):
    preset: str = "tiny-code-eagle3"
    ttt_steps: int = 7  # chained steps unrolled per training position


def chain_tau(correct: Tensor) -> float:
    """τ if every position started a greedy round of len(correct) chained drafts: correct
    [steps, b, T] (step j's agreement at t belongs to the chain started at t - j)."""
    steps, _, t = correct.shape
    starts = torch.arange(t - steps + 1, device=correct.device)
    runs = torch.stack([correct[j][:, starts + j] for j in range(steps)], dim=-1)  # [b, starts, steps]
    return 1.0 + float(runs.long().cumprod(dim=-1).sum(-1).float().mean())


def train_eagle3(target: TargetModel, corpus: dict, out: Path, cfg: Eagle3TrainConfig, device,
                 init: Path | None = None) -> Summary:
    """``corpus`` as written by build_corpus; ``init`` continues from a head checkpoint."""
    if init is not None:
        raw, model = read_config_json(init), load_eagle3(init).float()
    else:
        raw = {**lookup_preset(PRESETS, cfg.preset, "eagle3"), "vocab_size": target.config.vocab_size,
               "draft_vocab_size": target.config.vocab_size}  # the full vocabulary: identity d2t
        model = Eagle3DraftModel(eagle3_config(raw))
        init_random(model, cfg.seed, model.config.layer.initializer_range)
        model.d2t.zero_()
        model.t2d.fill_(True)
    def objective(tokens: Tensor) -> tuple[Tensor, Tensor]:
        return training_loss(model, target, tokens, cfg.ttt_steps)

    return distill_chain("eagle3", model, raw, objective, chain_tau, target, corpus, out, cfg, device,
                         extra=lambda: {"d2t": model.d2t, "t2d": model.t2d})  # the vocabulary map, beside the weights
