"""Pretraining the tiny target: next-token cross-entropy on random windows of the corpus."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models.checkpoint import save_checkpoint
from ..models.config import model_config
from ..models.layers import causal_attention, init_random
from ..models.presets import TARGET_PRESETS
from ..models.target import TargetModel
from .loop import Budget, Schedule, Summary, autocast, log, train_loop


@dataclass(frozen=True)
class PretrainConfig(Schedule):
    preset: str = "tiny-code"
    steps: int = 2000
    batch_size: int = 64
    seq_len: int = 512
    weight_decay: float = 0.1


def random_windows(tokens: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, tokens.numel() - length - 1, (batch,), generator=gen)
    return torch.stack([tokens[s : s + length + 1] for s in starts.tolist()]).long()  # [B, L+1]


def lm_loss(model: TargetModel, windows: torch.Tensor) -> torch.Tensor:
    ids, labels = windows[:, :-1], windows[:, 1:]
    positions = torch.arange(ids.shape[1], device=ids.device)[None].expand_as(ids)
    hidden, _ = model(ids, positions, causal_attention)
    return F.cross_entropy(model.logits(hidden).flatten(0, 1), labels.flatten())


@torch.no_grad()
def heldout_loss(model: TargetModel, tokens: torch.Tensor, length: int, device, max_windows: int = 256,
                 budget: Budget | None = None) -> float:
    """Mean loss over the first ``max_windows`` windows, in batches of 32 (fewer batches once
    the budget is spent: the evaluation then measures what it has, as the drafters' do)."""
    n = min(max_windows, (tokens.numel() - 1) // length)
    chunks = tokens[: n * length + 1]
    windows = torch.stack([chunks[i * length : (i + 1) * length + 1] for i in range(n)]).long()
    total, seen = 0.0, 0
    for i, batch in enumerate(windows.split(32)):
        if i and budget is not None and budget.over():
            break
        with autocast(device):
            total += float(lm_loss(model, batch.to(device))) * batch.shape[0]
        seen += batch.shape[0]
    return total / seen


def target_config(preset: str, vocab_size: int, eos_id: int) -> dict:
    return {**TARGET_PRESETS[preset], "vocab_size": vocab_size, "eos_token_id": eos_id}


def pretrain(train: torch.Tensor, heldout_tokens: torch.Tensor, vocab_size: int, eos_id: int, out: Path,
             cfg: PretrainConfig, device: torch.device) -> Summary:
    budget = Budget(cfg.max_seconds)  # from the start: init and the first evaluation count too
    raw = target_config(cfg.preset, vocab_size, eos_id)
    model = TargetModel(model_config(raw))
    init_random(model, cfg.seed, model.config.initializer_range)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed)
    params = sum(p.numel() for p in model.parameters())
    log.info("pretrain.start", params=params, tokens=train.numel(), device=str(device), **cfg.__dict__)

    def heldout() -> dict[str, float]:
        held = heldout_loss(model, heldout_tokens, cfg.seq_len, device, budget=budget)
        return {"heldout_loss": held, "heldout_ppl": math.exp(held)}

    def loss() -> torch.Tensor:
        return lm_loss(model, random_windows(train, cfg.batch_size, cfg.seq_len, gen).to(device))

    summary = train_loop("target", model, opt, loss, heldout, cfg, device, budget=budget,
                         save=lambda _: save_checkpoint(out, {**raw, "torch_dtype": "bfloat16"}, model,
                                                        dtype=torch.bfloat16))
    log.info("pretrain.done", summary=summary.report(), out=str(out))
    return summary
