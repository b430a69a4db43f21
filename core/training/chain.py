"""What training a chain drafter (EAGLE-3, frozen-KV MTP) shares: windows of the distilled
text, a held-out evaluation, and the run itself (data, optimizer, loop, checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from ..models.checkpoint import save_checkpoint
from ..models.target import TargetModel
from .distill import DistillConfig, Distilled, distill_data, pack, unpack
from .loop import Budget, Summary, autocast, log, train_loop
from .state import Position, StateWriter, restore

# a drafter's objective over a batch of token windows [b, L] -> (loss, correct [steps, b, T] bool,
# overlap [steps, b, T]: sum(min(p, q)), the chance a draft sampled from q is accepted)
Objective = Callable[[Tensor], tuple[Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class ChainTrainConfig(DistillConfig):
    crop: int = 128  # tokens per training row: a random window of a distilled sequence


def crop_batch(data: Distilled, cfg: ChainTrainConfig, gen: torch.Generator) -> Tensor:
    """[batch_size, crop] random windows of random distilled rows."""
    rows = torch.randint(0, data.tokens.shape[0], (cfg.batch_size,), generator=gen)
    length = min(cfg.crop, data.tokens.shape[1])
    start = torch.randint(0, data.tokens.shape[1] - length + 1, (cfg.batch_size,), generator=gen)
    index = (start[:, None] + torch.arange(length)).to(data.tokens.device)
    return data.tokens[rows.to(data.tokens.device)].gather(1, index)


@torch.no_grad()
def heldout(objective: Objective, tau: Callable[[Tensor], float], held: Distilled,
            cfg: ChainTrainConfig, budget: Budget | None = None) -> dict[str, float]:
    """A chain drafter's held-out loss and τ estimates over 8 fixed batches of windows (fewer
    once the budget is spent): greedy, and with drafts sampled from the drafter at temperature 1."""
    gen = torch.Generator().manual_seed(1234)
    losses, taus, sampled = [], [], []
    for i in range(8):
        if i and budget is not None and budget.over():
            break
        with autocast(held.tokens.device):
            loss, correct, overlap = objective(crop_batch(held, cfg, gen))
        losses.append(float(loss))
        taus.append(tau(correct))
        sampled.append(tau(overlap))
    return {"heldout_loss": sum(losses) / len(losses), "heldout_tau_est": sum(taus) / len(taus),
            "heldout_sampled_tau_est": sum(sampled) / len(sampled)}


def distill_chain(name: str, model: nn.Module, raw: dict[str, Any], objective: Objective,
                  tau: Callable[[Tensor], float], target: TargetModel, corpus: dict | None, out: Path,
                  cfg: ChainTrainConfig, device, extra: Callable[[], dict[str, Tensor]] | None = None,
                  resume: dict | None = None) -> Summary:
    """Generate the target's text, train ``model`` on windows of it with ``objective``, and
    save it in bf16 under ``raw`` (its config.json) with ``extra()`` tensors beside it;
    ``resume`` (a training state, from load_state) continues that run on its own data."""
    budget = Budget(cfg.max_seconds)
    model.to(device)
    target.to(device).eval().requires_grad_(False)
    if resume is not None:
        data, held = (unpack(resume["data"], part, device) for part in ("train", "held"))
    else:
        log.info(f"{name}.generate", sequences=cfg.num_sequences,
                 tokens=cfg.num_sequences * (cfg.prompt_len + cfg.gen_len))
        data = distill_data(target, corpus, "train", cfg, cfg.num_sequences, cfg.seed, device, budget=budget)
        held = distill_data(target, corpus, "heldout", cfg, max(1, cfg.num_sequences // 8), cfg.seed + 1, device,
                            budget=budget)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed)
    start = Position() if resume is None else restore(resume, model, opt, gen)
    writer = StateWriter(out, name, cfg, target, pack(train=data, held=held))

    def save(pos: Position) -> None:
        save_checkpoint(out, {**raw, "torch_dtype": "bfloat16"}, model, extra=extra() if extra else None,
                        dtype=torch.bfloat16)
        writer.save(pos, model, opt, gen)

    summary = train_loop(name, model, opt, lambda: objective(crop_batch(data, cfg, gen))[0],
                         lambda: heldout(objective, tau, held, cfg, budget), cfg, device, save=save, budget=budget,
                         start=start)
    log.info(f"{name}.done", summary=summary.report(), out=str(out))
    return summary
