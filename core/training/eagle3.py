"""EAGLE-3 head training by self-distillation: the unrolled training-time test over text the
target wrote (core.methods.eagle3.training_loss), on the data distill.py generates."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from ..methods.eagle3 import training_loss
from ..models.checkpoint import save_checkpoint
from ..models.config import read_config_json
from ..models.eagle3 import PRESETS, Eagle3DraftModel, eagle3_config, load_eagle3
from ..models.layers import init_random
from ..models.target import TargetModel
from .distill import DistillConfig, Distilled, distill_data
from .loop import Summary, autocast, log, train_loop


@dataclass(frozen=True)
class Eagle3TrainConfig(DistillConfig):
    preset: str = "tiny-code-eagle3"
    ttt_steps: int = 7  # chained steps unrolled per training position
    crop: int = 128  # tokens per training row: a random window of a distilled sequence


def crop_batch(data: Distilled, cfg: Eagle3TrainConfig, gen: torch.Generator) -> Tensor:
    """[batch_size, crop] random windows of random distilled rows."""
    rows = torch.randint(0, data.tokens.shape[0], (cfg.batch_size,), generator=gen)
    length = min(cfg.crop, data.tokens.shape[1])
    start = torch.randint(0, data.tokens.shape[1] - length + 1, (cfg.batch_size,), generator=gen)
    index = (start[:, None] + torch.arange(length)).to(data.tokens.device)
    return data.tokens[rows.to(data.tokens.device)].gather(1, index)


def chain_tau(correct: Tensor) -> float:
    """τ if every position started a greedy round of len(correct) chained drafts: correct
    [steps, b, T] (step j's agreement at t belongs to the chain started at t - j)."""
    steps, _, t = correct.shape
    starts = torch.arange(t - steps + 1, device=correct.device)
    runs = torch.stack([correct[j][:, starts + j] for j in range(steps)], dim=-1)  # [b, starts, steps]
    return 1.0 + float(runs.long().cumprod(dim=-1).sum(-1).float().mean())


@torch.no_grad()
def heldout(objective: Callable[[Tensor], tuple[Tensor, Tensor]], tau: Callable[[Tensor], float], held: Distilled,
            cfg: DistillConfig) -> dict[str, float]:
    """A chain drafter's held-out loss and τ estimate over 8 fixed batches of windows."""
    gen = torch.Generator().manual_seed(1234)
    losses, taus = [], []
    for _ in range(8):
        with autocast(held.tokens.device):
            loss, correct = objective(crop_batch(held, cfg, gen))
        losses.append(float(loss))
        taus.append(tau(correct))
    return {"heldout_loss": sum(losses) / len(losses), "heldout_tau_est": sum(taus) / len(taus)}


def evaluate(model: Eagle3DraftModel, target: TargetModel, held: Distilled, cfg: Eagle3TrainConfig) -> dict[str, float]:
    return heldout(lambda tokens: training_loss(model, target, tokens, cfg.ttt_steps), chain_tau, held, cfg)


def train_eagle3(target: TargetModel, corpus: dict, out: Path, cfg: Eagle3TrainConfig, device,
                 init: Path | None = None) -> Summary:
    """``corpus`` as written by build_corpus; ``init`` continues from a head checkpoint."""
    if init is not None:
        raw, model = read_config_json(init), load_eagle3(init).float()
    else:
        if cfg.preset not in PRESETS:
            raise KeyError(f"unknown eagle3 preset {cfg.preset!r}; known: {', '.join(sorted(PRESETS))}")
        raw = {**PRESETS[cfg.preset], "vocab_size": target.config.vocab_size,
               "draft_vocab_size": target.config.vocab_size}  # the full vocabulary: identity d2t
        model = Eagle3DraftModel(eagle3_config(raw))
        init_random(model, cfg.seed, model.config.layer.initializer_range)
        model.d2t.zero_()
        model.t2d.fill_(True)
    model.to(device)
    target.to(device).eval().requires_grad_(False)
    log.info("eagle3.generate", sequences=cfg.num_sequences, tokens=cfg.num_sequences * (cfg.prompt_len + cfg.gen_len))
    data = distill_data(target, corpus, "train", cfg, cfg.num_sequences, cfg.seed, device)
    held = distill_data(target, corpus, "heldout", cfg, cfg.num_sequences // 8, cfg.seed + 1, device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed)

    def loss() -> Tensor:
        return training_loss(model, target, crop_batch(data, cfg, gen), cfg.ttt_steps)[0]

    summary = train_loop("eagle3", model, opt, loss, lambda: evaluate(model, target, held, cfg), cfg, device)
    model.to(torch.bfloat16)
    save_checkpoint(out, {**raw, "torch_dtype": "bfloat16"}, model, extra={"d2t": model.d2t, "t2d": model.t2d})
    log.info("eagle3.done", summary=summary.report(), out=str(out))
    return summary
