"""Shared training plumbing: device choice, LR schedule, progress bars, structured logs."""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import structlog
import torch
from tqdm import tqdm

from .state import Position

log = structlog.get_logger("draftline.train")


def pick_device(requested: str = "auto") -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def autocast(device: torch.device):
    """bf16 autocast on the GPU; float32 on the CPU (bf16 matmuls there are slow, not faster)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def cosine_lr(step: int, total: int, peak: float, warmup: int, time_fraction: float = 0.0) -> float:
    """Warmup then cosine decay to 3% of peak; a time budget counts as progress too, so a
    run cut short by its budget still ends with a decayed learning rate."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = max((step - warmup) / max(1, total - warmup), time_fraction)
    return peak * (0.03 + 0.97 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


@dataclass
class Summary:
    what: str
    steps: int = 0
    resumed_at: int = 0  # the step a resumed run started from
    loss: float = float("nan")
    heldout: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    run_started: float | None = None  # the run's own start (its budget's, generation included), for the report

    @property
    def wall_s(self) -> float:
        return time.perf_counter() - self.started

    def time_fraction(self, budget: float | None) -> float:
        return 0.0 if budget is None else self.wall_s / budget

    def report(self) -> str:
        resumed = f" (resumed at step {self.resumed_at})" if self.resumed_at else ""
        parts = [f"{self.what}: {self.steps} steps{resumed}", f"final loss {self.loss:.4f}"]
        parts += [f"{k} {v:.4f}" for k, v in self.heldout.items()]
        parts.append(f"wall {time.perf_counter() - (self.run_started or self.started):.1f} s")
        return ", ".join(parts)


def _estimate(name: str, summary: Summary, first_s: float, ran: int, steps: int, left: float | None,
              bar: tqdm) -> None:
    """From the ``ran`` steps timed so far: how many the run will take and how long, budget
    included. The bar's total becomes the steps the budget allows, so its ETA tells the truth."""
    per_step = (summary.wall_s - first_s) / (ran - 1)
    total = steps if left is None else max(summary.steps, min(steps, summary.steps + int((left - summary.wall_s) / per_step)))
    bar.total = total
    bar.refresh()
    log.info(f"{name}.estimate", step_s=round(per_step, 3), steps=total, of_steps=steps,
             seconds_left=round((total - summary.steps) * per_step, 1),
             limited_by="max_seconds" if total < steps else "steps")


def progress(total: int, desc: str, initial: int = 0) -> tqdm:
    return tqdm(total=total, desc=desc, initial=initial, unit="step", dynamic_ncols=True, mininterval=2.0)


@dataclass(frozen=True)
class Schedule:
    """What every training run shares: how long, how fast, how often to evaluate."""

    steps: int = 3000
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 100
    seed: int = 0
    eval_every: int = 500
    max_seconds: float | None = None  # the whole run's wall time: generation, steps, evaluation, saving


@dataclass(frozen=True)
class Budget:
    """A run's wall-time budget, from its start: what is left, and when generation must stop."""

    max_seconds: float | None
    started: float = field(default_factory=time.perf_counter)

    def left(self) -> float | None:
        return None if self.max_seconds is None else self.max_seconds - (time.perf_counter() - self.started)

    def over(self) -> bool:
        """Spent: an evaluation then measures what it has so far, rather than run on past the budget."""
        return self.max_seconds is not None and time.perf_counter() - self.started > self.max_seconds

    def generation_over(self, share: float) -> bool:
        """Past ``share`` of the budget: stop generating (the steps need the rest)."""
        return self.max_seconds is not None and time.perf_counter() - self.started > share * self.max_seconds


ESTIMATE_AFTER_S = 5.0  # time the first steps this long before estimating the rest


def train_loop(name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[[], torch.Tensor],
               eval_fn: Callable[[], dict[str, float]], cfg: Schedule, device: torch.device,
               save: Callable[[Position], None] | None = None, budget: Budget | None = None,
               start: Position = Position()) -> Summary:
    """Steps from ``start`` until cfg.steps or the time budget, evaluating (and calling
    ``save`` with the position reached) every cfg.eval_every steps and at the end; ``budget``
    is the run's, started before generation."""
    budget = budget or Budget(cfg.max_seconds)
    left = budget.left()
    summary = Summary(name, steps=start.step, resumed_at=start.step, run_started=budget.started)
    if budget.over():  # generation spent the budget: no step fits; what there is is evaluated and saved
        log.info(f"{name}.time_budget_reached", step=start.step, max_seconds=cfg.max_seconds)
        model.eval()
        summary.heldout = eval_fn()
        if save is not None:
            save(start)
        return summary
    bar = progress(cfg.steps, name, initial=start.step)  # its rate counts this run's steps only
    estimated, last = False, 0.0
    model.train()
    for step in range(start.step, cfg.steps):
        # a resumed run's budget decays what the schedule had left, from where it stood
        time_progress = start.time_progress + (1 - start.time_progress) * summary.time_fraction(left)
        set_lr(opt, cosine_lr(step, cfg.steps, cfg.lr, cfg.warmup, time_progress))
        with autocast(device):
            loss = loss_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        summary.steps, summary.loss, ran = step + 1, loss.item(), step + 1 - start.step
        bar.update(1)
        bar.set_postfix(loss=f"{summary.loss:.3f}", refresh=False)
        step_s, last = summary.wall_s - last, summary.wall_s
        out_of_time = left is not None and summary.wall_s + step_s > left  # the next step would end past it
        if ran == 1:
            first_s = summary.wall_s  # the first step pays one-time costs: the estimate leaves it out
        soon = ESTIMATE_AFTER_S if left is None else min(ESTIMATE_AFTER_S, 0.1 * left)
        if not estimated and ran >= 2 and (summary.wall_s > soon or out_of_time):
            estimated = True
            _estimate(name, summary, first_s, ran, cfg.steps, left, bar)
        evaluate = (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps or out_of_time
        if evaluate:
            model.eval()
            summary.heldout = eval_fn()
            model.train()
            log.info(f"{name}.eval", step=step + 1, loss=round(summary.loss, 4),
                     **{k: round(v, 4) for k, v in summary.heldout.items()})
            if save is not None:  # a checkpoint at every evaluation: a run cut off later keeps this one
                save(Position(step + 1, time_progress))
        if out_of_time or (evaluate and budget.over()):  # an evaluation that ran past the budget ends the run
            log.info(f"{name}.time_budget_reached", step=step + 1, max_seconds=cfg.max_seconds)
            break
    bar.close()
    model.eval()
    return summary
