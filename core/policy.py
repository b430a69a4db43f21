"""When to draft: speculation must never make a step slower per emitted token than plain
decoding. The policy is per batch size, since large batches turn the target's verify from
memory-bound into compute-bound and drafting stops paying."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Arm:
    """Exponential moving average of seconds per emitted token for one choice."""

    seconds_per_token: float = math.nan
    samples: int = 0

    def record(self, seconds: float, tokens: int, weight: float = 0.2) -> None:
        value = seconds / max(1, tokens)
        self.seconds_per_token = value if self.samples == 0 else (1 - weight) * self.seconds_per_token + weight * value
        self.samples += 1


@dataclass
class DraftPolicy:
    """``limit``: "always", "auto", or the largest batch that drafts."""

    limit: int | str = "auto"
    probe_every: int = 32  # re-measure the losing choice this often, so changes are noticed
    warmup: int = 3  # samples of each choice before trusting the comparison
    arms: dict[tuple[int, bool], Arm] = field(default_factory=dict)
    steps: int = 0

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, batch_size - 1).bit_length()  # 1, 2, 4, 8, ...

    def should_draft(self, batch_size: int) -> bool:
        if self.limit == "always":
            return True
        if isinstance(self.limit, int):
            return batch_size <= self.limit
        self.steps += 1
        b = self.bucket(batch_size)
        on, off = self.arms.get((b, True), Arm()), self.arms.get((b, False), Arm())
        if on.samples < self.warmup or off.samples < self.warmup:
            return on.samples <= off.samples
        better = on.seconds_per_token <= off.seconds_per_token
        return (not better) if self.steps % self.probe_every == 0 else better

    def record(self, batch_size: int, drafted: bool, seconds: float, tokens: int) -> None:
        self.arms.setdefault((self.bucket(batch_size), drafted), Arm()).record(seconds, tokens)

    def table(self) -> list[dict]:
        return [
            {"batch_bucket": b, "drafting": d, "ms_per_token": round(a.seconds_per_token * 1e3, 3), "samples": a.samples}
            for (b, d), a in sorted(self.arms.items())
        ]
