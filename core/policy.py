"""When to draft: speculation must never make a step slower per emitted token than plain
decoding. The policy is per batch size, since large batches turn the target's verify from
memory-bound into compute-bound and drafting stops paying."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

WINDOW = 16  # the latest rounds an estimate is made of
PRIOR_ROUNDS = 16  # drafted rounds the history counts for beside the rows' own (a hard start must not turn drafting off)
TOKENS_HORIZON = 256  # rounds the drafted tokens a row are averaged over
CLEAR_GAIN = 1.5  # one choice this many times faster a token than the other: probe it less


@dataclass
class Arm:
    """One choice at one batch bucket: the median time of its latest rounds (one slow round,
    a cold start or a hiccup, cannot hold a choice down), and the tokens a row averaged over
    many requests' rounds (the prior for rows that have drafted little yet: one request's hard
    stretch must not turn drafting off for the next)."""

    times: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # seconds a round
    tokens_per_row: float = 1.0  # a slow moving average over rounds: across many requests
    rounds: int = 0

    def record(self, seconds: float, tokens_per_row: float) -> None:
        self.rounds += 1
        weight = max(1.0 / self.rounds, 1.0 / TOKENS_HORIZON)
        self.tokens_per_row += weight * (tokens_per_row - self.tokens_per_row)
        if self.rounds > 1:  # the first round of a choice pays its one-time costs
            self.times.append(seconds)

    @property
    def known(self) -> bool:
        return len(self.times) >= 2

    @property
    def seconds(self) -> float:
        return statistics.median(self.times) if self.times else math.nan


@dataclass(frozen=True)
class Drafted:
    """What the rows of a round to be launched have drafted so far: their drafted rounds and
    the tokens those emitted (summed over the rows)."""

    rounds: int = 0
    tokens: int = 0


@dataclass
class Bucket:
    on: Arm = field(default_factory=Arm)
    off: Arm = field(default_factory=Arm)
    decisions: int = 0
    spent: float = 0.0  # seconds of this bucket's rounds recorded since its last probe

    def choice(self, tau_prior: float, drafted: Drafted = Drafted()) -> bool | None:
        gain = self.gain(tau_prior, drafted)
        return None if gain is None else gain >= 1.0

    def gain(self, tau_prior: float, drafted: Drafted = Drafted()) -> float | None:
        """Plain decoding's time a token over drafting's, once both are measured (None before):
        a drafting round's median time over the tokens a row of *these* rows' drafted rounds
        emitted (``tau_prior``, the
        policy's tokens a row over every bucket's drafted rounds, standing in for PRIOR_ROUNDS
        rounds), against a plain round's one token. Not the median of each round's seconds per
        token: a drafting round's time is steady while its tokens range from 1 to K + 1, so that
        median sits near the typical rejection and overstates drafting's cost by half (dflash,
        tau 3.8); and not the history alone, which one request's hard stretch would turn
        against the next request."""
        if not (self.on.known and self.off.known):
            return None
        tau = (drafted.tokens + PRIOR_ROUNDS * tau_prior) / (drafted.rounds + PRIOR_ROUNDS)
        return (self.off.seconds / self.off.tokens_per_row) / max(self.on.seconds / max(tau, 1e-9), 1e-12)


@dataclass
class DraftPolicy:
    """``limit``: "always", "auto", or the largest batch that drafts. ``auto`` measures both
    choices at each batch bucket (a few rounds each, drafting first), then takes the faster for
    the rows at hand, re-measuring the other with one round each time the bucket's rounds have
    taken ``probe_every`` - 1 of that round's measured time (4 x as long where one is
    CLEAR_GAIN times faster: a probe there costs most and is least likely to change the
    choice). So a probe takes about 1 / ``probe_every`` of the time whatever the two rounds
    cost: counted in rounds, a drafting round eight times a plain one's probed once in 16 took
    a third of the time (a 10% loss where plain decoding is 1.35x faster). A bucket not yet measured follows its
    measured neighbours where they settle it (drafting pays less as the batch grows: a larger
    bucket that drafts means this one drafts too, a smaller one that does not means this one
    does not), so a batch shrinking through new buckets at the end of its requests does not
    spend its rounds measuring each."""

    limit: int | str = "auto"
    probe_every: int = 16
    buckets: dict[int, Bucket] = field(default_factory=dict)
    drafting: Arm = field(default_factory=Arm)  # tokens a row of drafted rounds, every bucket's: the rows' prior

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, batch_size - 1).bit_length()  # 1, 2, 4, 8, ...

    def should_draft(self, batch_size: int, drafted: Drafted = Drafted()) -> bool:
        if self.limit == "always":
            return True
        if isinstance(self.limit, int):
            return batch_size <= self.limit
        size = self.bucket(batch_size)
        b = self.buckets.setdefault(size, Bucket())
        b.decisions += 1
        gain = b.gain(self.drafting.tokens_per_row, drafted)
        best = self._neighbours(size) if gain is None else gain >= 1.0
        if best is None:  # measuring: whichever has fewer rounds, drafting first
            return b.on.rounds <= b.off.rounds
        if self._probe_due(b, best, gain):
            b.spent = 0.0
            return not best
        return best

    def _probe_due(self, b: Bucket, best: bool, gain: float | None) -> bool:
        """A measured bucket probes by time (see the class); one that follows its neighbours
        has no time for the other choice yet: one round in ``probe_every``."""
        if gain is None:
            return b.decisions % self.probe_every == 0
        clear = max(gain, 1 / max(gain, 1e-12)) >= CLEAR_GAIN
        other = b.off if best else b.on
        return b.spent >= (self.probe_every - 1) * (4 if clear else 1) * other.seconds

    def _choice(self, size: int) -> bool | None:
        """The bucket's own choice once it is measured, else its neighbours' where they settle it."""
        own = self.buckets[size].choice(self.drafting.tokens_per_row)
        return self._neighbours(size) if own is None else own

    def _neighbours(self, size: int) -> bool | None:
        """What the measured buckets settle for an unmeasured one of ``size`` (None: nothing)."""
        others = {s: b.choice(self.drafting.tokens_per_row) for s, b in self.buckets.items() if s != size}
        if any(chosen for s, chosen in others.items() if s > size):
            return True
        if any(chosen is False for s, chosen in others.items() if s < size):
            return False
        return None

    def record(self, batch_size: int, drafted: bool, seconds: float, tokens: int) -> None:
        b = self.buckets.setdefault(self.bucket(batch_size), Bucket())
        b.spent += seconds
        (b.on if drafted else b.off).record(seconds, tokens / batch_size)
        if drafted:
            self.drafting.record(seconds, tokens / batch_size)

    def table(self) -> list[dict]:
        """Per batch bucket: each choice's measured ms per token and rounds, and the current
        choice (measured or inferred; None while measuring)."""
        out = []
        for size, b in sorted(self.buckets.items()):
            choice = self._choice(size)
            for drafting, arm in ((False, b.off), (True, b.on)):
                per_row = self.drafting.tokens_per_row if drafting else arm.tokens_per_row
                out.append({"batch_bucket": size, "drafting": drafting,
                            "ms_per_token": round(arm.seconds / per_row * 1e3, 3), "rounds": arm.rounds,
                            "chosen": None if choice is None else choice == drafting})
        return out
