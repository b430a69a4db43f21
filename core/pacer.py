"""How much prompt one step prefills while other requests decode.

A prefill launched between the running requests' rounds holds back each of their next tokens
for its whole length: a burst of arrivals prefilled at once stalls every stream for several of
its rounds (docs/RESULTS.md, serving). The pacer
learns what a round and a prompt token cost on this machine, from the flights the machine
collects, and bounds a step's prefill while others decode to ``stall`` rounds' time, so that a
stream's longest gap stays near 1 + ``stall`` times its usual one. Arrivals beyond the bound go
in the next steps; with nothing decoding the bound is lifted (nobody waits).
"""

from __future__ import annotations

from collections import deque
from statistics import median

MIN_TOKENS = 128  # prompt tokens a step may always take: thinner chunks cost more in launches than they spare


class Pacer:
    def __init__(self, stall: float | None, min_tokens: int = MIN_TOKENS):
        self.stall = stall  # rounds' time a step's prefill may take while others decode (None: unbounded)
        self.min_tokens = min_tokens
        self.prefills: deque[tuple[int, float]] = deque(maxlen=32)  # recent prefills: (prompt tokens, seconds)
        self.rounds: deque[float] = deque(maxlen=16)  # recent rounds' seconds

    def prefilled(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefills.append((tokens, seconds))

    def rounded(self, seconds: float) -> None:
        if seconds > 0:
            self.rounds.append(seconds)

    def budget(self, cap: float) -> float:
        """Prompt tokens a step may prefill beside decoding requests: ``cap`` (the spec's
        max_num_batched_tokens), lowered to what costs ``stall`` of a median recent round."""
        if self.stall is None or not self.prefills or not self.rounds:
            return cap
        fixed, per_token = self.cost()
        allowed = (self.stall * median(self.rounds) - fixed) / per_token
        return min(cap, max(self.min_tokens, int(allowed)))

    def cost(self) -> tuple[float, float]:
        """(seconds a prefill costs whatever its size, seconds a prompt token) by least squares
        over the recent prefills; all per token where their sizes do not tell the two apart."""
        n = len(self.prefills)
        mean_t = sum(t for t, _ in self.prefills) / n
        mean_s = sum(s for _, s in self.prefills) / n
        var = sum((t - mean_t) ** 2 for t, _ in self.prefills)
        if var > 0:
            slope = sum((t - mean_t) * (s - mean_s) for t, s in self.prefills) / var
            fixed = mean_s - slope * mean_t
            if slope > 0 and fixed >= 0:
                return fixed, slope
        return 0.0, mean_s / mean_t
