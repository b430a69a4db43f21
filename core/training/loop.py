"""Shared training plumbing: device choice, LR schedule, progress bars, structured logs."""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import structlog
import torch
from tqdm import tqdm

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
    loss: float = float("nan")
    heldout: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    @property
    def wall_s(self) -> float:
        return time.perf_counter() - self.started

    def time_fraction(self, budget: float | None) -> float:
        return 0.0 if budget is None else self.wall_s / budget

    def report(self) -> str:
        parts = [f"{self.what}: {self.steps} steps", f"final loss {self.loss:.4f}"]
        parts += [f"{k} {v:.4f}" for k, v in self.heldout.items()]
        parts.append(f"wall {self.wall_s:.1f} s")
        return ", ".join(parts)


def progress(total: int, desc: str) -> tqdm:
    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, mininterval=2.0)
