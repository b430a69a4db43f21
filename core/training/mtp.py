"""Frozen-KV MTP drafter training by self-distillation: chained steps over text the target
wrote (core.methods.gemma4_mtp.training_loss), on the data distill.py generates."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..methods.gemma4_mtp import training_loss
from ..models.checkpoint import save_checkpoint
from ..models.config import read_config_json
from ..models.gemma4_mtp import PRESETS, Gemma4MTPModel, load_mtp, mtp_config
from ..models.layers import init_random
from ..models.target import TargetModel
from .distill import DistillConfig, Distilled, distill_data
from .eagle3 import crop_batch, heldout
from .loop import Summary, log, train_loop


@dataclass(frozen=True)
class MTPTrainConfig(DistillConfig):
    preset: str = "tiny-code-mtp"
    chain_steps: int = 4  # chained steps trained per context end
    crop: int = 128  # tokens per training row: a random window of a distilled sequence


def fixed_chain_tau(correct: Tensor) -> float:
    """τ if every context end c started a greedy round of len(correct) drafts: correct
    [steps, b, T] (step j's agreement at c belongs to the chain started at c)."""
    steps, _, t = correct.shape
    runs = correct[:, :, : t - steps + 1].permute(1, 2, 0)  # [b, starts, steps]
    return 1.0 + float(runs.long().cumprod(dim=-1).sum(-1).float().mean())


def evaluate(model: Gemma4MTPModel, target: TargetModel, held: Distilled, cfg: MTPTrainConfig) -> dict[str, float]:
    return heldout(lambda tokens: training_loss(model, target, tokens, cfg.chain_steps), fixed_chain_tau, held, cfg)


def train_mtp(target: TargetModel, corpus: dict, out: Path, cfg: MTPTrainConfig, device,
              init: Path | None = None) -> Summary:
    """``corpus`` as written by build_corpus; ``init`` continues from a drafter checkpoint."""
    if init is not None:
        raw, model = read_config_json(init), load_mtp(init).float()
    else:
        if cfg.preset not in PRESETS:
            raise KeyError(f"unknown gemma4_mtp preset {cfg.preset!r}; known: {', '.join(sorted(PRESETS))}")
        raw = {**PRESETS[cfg.preset], "vocab_size": target.config.vocab_size}
        model = Gemma4MTPModel(mtp_config(raw))
        init_random(model, cfg.seed, model.config.layers.initializer_range)
    model.to(device)
    target.to(device).eval().requires_grad_(False)
    log.info("mtp.generate", sequences=cfg.num_sequences, tokens=cfg.num_sequences * (cfg.prompt_len + cfg.gen_len))
    data = distill_data(target, corpus, "train", cfg, cfg.num_sequences, cfg.seed, device)
    held = distill_data(target, corpus, "heldout", cfg, max(cfg.gen_batch, cfg.num_sequences // 8), cfg.seed + 1,
                        device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed)

    def loss() -> Tensor:
        return training_loss(model, target, crop_batch(data, cfg, gen), cfg.chain_steps)[0]

    summary = train_loop("gemma4_mtp", model, opt, loss, lambda: evaluate(model, target, held, cfg), cfg, device)
    save_checkpoint(out, {**raw, "torch_dtype": "bfloat16"}, model.to(torch.bfloat16))
    log.info("mtp.done", summary=summary.report(), out=str(out))
    return summary
