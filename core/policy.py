"""When to draft: speculation must never make a step slower per emitted token than plain
decoding. The policy is per batch size, since large batches turn the target's verify from
memory-bound into compute-bound and drafting stops paying."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

WINDOW = 8  # the latest rounds an estimate is the median of


@dataclass
class Arm:
    """Seconds per emitted token for one choice at one batch bucket: the median of its latest
    rounds, so one slow round (a cold start, a hiccup) cannot hold a choice down."""

    recent: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    rounds: int = 0

    def record(self, seconds: float, tokens: int) -> None:
        self.rounds += 1
        if self.rounds > 1:  # the first round of a choice pays its one-time costs
            self.recent.append(seconds / max(1, tokens))

    @property
    def known(self) -> bool:
        return len(self.recent) >= 2

    @property
    def seconds_per_token(self) -> float:
        return statistics.median(self.recent) if self.recent else math.nan


@dataclass
class Bucket:
    on: Arm = field(default_factory=Arm)
    off: Arm = field(default_factory=Arm)
    decisions: int = 0

    def choice(self) -> bool | None:
        """The faster choice once both are measured (None before)."""
        if not (self.on.known and self.off.known):
            return None
        return self.on.seconds_per_token <= self.off.seconds_per_token


@dataclass
class DraftPolicy:
    """``limit``: "always", "auto", or the largest batch that drafts. ``auto`` measures both
    choices at each batch bucket (a few rounds each, drafting first), then takes the faster,
    re-measuring the other one round in ``probe_every`` of that bucket's rounds."""

    limit: int | str = "auto"
    probe_every: int = 16
    buckets: dict[int, Bucket] = field(default_factory=dict)

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, batch_size - 1).bit_length()  # 1, 2, 4, 8, ...

    def should_draft(self, batch_size: int) -> bool:
        if self.limit == "always":
            return True
        if isinstance(self.limit, int):
            return batch_size <= self.limit
        b = self.buckets.setdefault(self.bucket(batch_size), Bucket())
        b.decisions += 1
        best = b.choice()
        if best is None:  # measuring: whichever has fewer rounds, drafting first
            return b.on.rounds <= b.off.rounds
        return (not best) if b.decisions % self.probe_every == 0 else best

    def record(self, batch_size: int, drafted: bool, seconds: float, tokens: int) -> None:
        b = self.buckets.setdefault(self.bucket(batch_size), Bucket())
        (b.on if drafted else b.off).record(seconds, tokens)

    def table(self) -> list[dict]:
        """Per batch bucket: each choice's measured ms per token and rounds, and the current choice."""
        out = []
        for size, b in sorted(self.buckets.items()):
            choice = b.choice()
            for drafting, arm in ((False, b.off), (True, b.on)):
                out.append({"batch_bucket": size, "drafting": drafting,
                            "ms_per_token": round(arm.seconds_per_token * 1e3, 3), "rounds": arm.rounds,
                            "chosen": None if choice is None else choice == drafting})
        return out
