"""When to draft, and how many drafts to verify: speculation must never make a step slower per
emitted token than plain decoding. The policy is per batch size, since large batches turn the
target's verify from memory-bound into compute-bound: there a full verify stops paying, while a
narrower one (the round's first drafts only, its later positions the least likely accepted)
may still pay."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

WINDOW = 16  # the latest rounds an estimate is made of
PRIOR_ROUNDS = 16  # drafted rounds the history counts for beside the rows' own (a hard start must not turn drafting off)
HISTORY = 4096  # drafted row-rounds the acceptance model weighs (older ones count half, then less)
UNSEEN = 0.5  # a position's acceptance before any round drafted that far
CLEAR_GAIN = 1.5  # one choice this many times faster a token than the other: probe it less


@dataclass
class Arm:
    """One verify width at one batch bucket (width 1: plain decoding): the median time of its
    latest rounds (one slow round, a cold start or a hiccup, cannot hold a choice down)."""

    times: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # seconds a round
    tokens_per_row: float = 1.0  # what its rounds emitted a row, a moving average (plain: 1 unless rows stop)
    rounds: int = 0
    since: float = 0.0  # seconds of the bucket's rounds since this arm last ran (probes are due by time)
    seconds: float = math.nan  # the median of ``times`` (kept: every decision reads it)

    def record(self, seconds: float, tokens_per_row: float) -> None:
        self.rounds += 1
        self.tokens_per_row += (tokens_per_row - self.tokens_per_row) / min(self.rounds, WINDOW)
        self.since = 0.0
        if self.rounds > 1:  # the first round of a choice pays its one-time costs
            self.times.append(seconds)
            self.seconds = statistics.median(self.times)

    @property
    def known(self) -> bool:
        return len(self.times) >= 2


class Acceptance:
    """How far drafts are accepted, over every drafted round of every batch size (a property of
    the method and the requests, not of the batch): per verify width, how many rows accepted 0,
    1, ... drafts. Position i's acceptance given position i - 1's is read from the rounds that
    drafted past i, so a round of any width informs every narrower one."""

    def __init__(self) -> None:
        self.counts: dict[int, list[float]] = {}  # width -> rows that accepted a drafts, a = 0 .. width - 1
        self.rows = 0.0
        self._accepted: list[float] | None = None  # [w]: expected accepted drafts at width w (None: stale)

    def record(self, width: int, accepted: Sequence[int]) -> None:
        counts = self.counts.setdefault(width, [0.0] * width)
        for a in accepted:
            counts[min(a, width - 1)] += 1
        self.rows += len(accepted)
        if self.rows > HISTORY:  # the requests served change: older rounds weigh less
            self.rows /= 2
            for c in self.counts.values():
                c[:] = [x / 2 for x in c]
        self._accepted = None

    def conditional(self, width: int) -> list[float]:
        """P(draft i accepted | draft i - 1 was), i = 1 .. width - 1."""
        reached, kept = [0.0] * width, [0.0] * width
        for w, counts in self.counts.items():
            tail = 0.0  # rows that accepted at least a drafts, a from w - 1 down
            at_least = [0.0] * (w + 1)
            for a in range(w - 1, -1, -1):
                tail += counts[a]
                at_least[a] = tail
            for i in range(1, min(w, width)):
                reached[i] += at_least[i - 1]
                kept[i] += at_least[i]
        return [kept[i] / reached[i] if reached[i] else UNSEEN for i in range(1, width)]

    def accepted(self, width: int) -> float:
        """Expected drafts accepted in a round verifying ``width`` tokens (width - 1 drafts)."""
        if self._accepted is None or width >= len(self._accepted):
            # every width's at once, from the widest: each round's decisions read several
            most = max(width, max(self.counts, default=1))
            table, total, p = [0.0, 0.0], 0.0, 1.0
            for c in self.conditional(most):
                p *= c
                total += p
                table.append(total)
            self._accepted = table
        return self._accepted[width]


@dataclass(frozen=True)
class Drafted:
    """What the rows of a round to be launched have drafted so far, summed over the rows: the
    drafts they accepted, and what the acceptance model expected of those rounds; and how
    many rows there are, how many of them sampled (temperature above 0)."""

    accepted: int = 0
    expected: float = 0.0
    rows: int = 0
    sampled: int = 0


@dataclass
class Bucket:
    """One batch bucket's arms. Where rounds are timed on the device, an arm's times are its
    device time, and the host's time a round (about the same whatever the width: its rows'
    bookkeeping) is kept for the bucket as a whole, from all its rounds: a round costs
    whichever of the two is longer, since the pipeline runs at the slower of them."""

    arms: dict[int, Arm] = field(default_factory=dict)  # verify width -> its arm
    widths: tuple[int, ...] = ()  # the drafting widths last offered here, widest first
    decisions: int = 0
    spent: float = 0.0  # seconds of this bucket's rounds since its last probe (of any arm)
    host_times: deque = field(default_factory=lambda: deque(maxlen=4 * WINDOW))  # host seconds a round
    host: float = 0.0  # their median

    def arm(self, width: int) -> Arm:
        arm = self.arms.get(width)  # not setdefault: an Arm (and its deque) made on every call
        if arm is None:
            arm = self.arms[width] = Arm()
        return arm

    def seconds(self, width: int) -> float:
        """What a round of ``width`` costs (NaN until measured)."""
        arm = self.arm(width)
        return arm.seconds if math.isnan(arm.seconds) else max(arm.seconds, self.host)


@dataclass
class DraftPolicy:
    """``limit``: "always" (the widest verify), "auto", or the largest batch that drafts.

    ``auto`` picks each round's verify width per batch bucket: 1 (plain decoding) or one of the
    drafting widths the backend runs there (the full K + 1, and narrower ones where the verify
    may be compute-bound). Each choice costs its arm's median round time over the tokens a row
    emits: 1 for plain decoding; for drafting, the tokens the acceptance model expects at that
    width, scaled by how the rows at hand have accepted against that model (their own history,
    with PRIOR_ROUNDS rounds of the model's beside it: one request's hard stretch must not turn
    drafting off for the next). A bucket measures the full width, then plain (a few rounds
    each, drafting first), then each narrower width that could still win were its round as
    fast as the slowest narrower choice measured (a verify's time grows with its width, and is
    never below a plain step's). It then takes the cheapest, probing the others in turn with
    one round each time the bucket's rounds have taken ``probe_every`` - 1 of the next one's
    round time (4 x as long where the chosen one is CLEAR_GAIN times cheaper), so the probes
    together take about 1 / ``probe_every`` of the time whatever each round costs and however
    many widths there are. A bucket not yet measured follows its measured neighbours where
    they settle it (drafting pays less as the batch grows: a larger bucket that drafts means
    this one drafts, at the full width; a smaller one that does not means this one does not),
    so a batch shrinking through new buckets at the end of its requests does not spend its
    rounds measuring each."""

    limit: int | str = "auto"
    # "always" verifies this width where the backend offers it (draftline bench --verify-widths)
    width: int | None = None
    probe_every: int = 16
    buckets: dict[int, Bucket] = field(default_factory=dict)
    acceptance: Acceptance = field(default_factory=Acceptance)  # greedy rows' drafts
    # sampled rows' drafts: accepted with the target's probability of them, far less often
    # than greedy rows' on the same text, so one model for both would draft for sampled rows
    # on the greedy rows' evidence (and stop drafting for greedy rows on the sampled rows')
    sampled_acceptance: Acceptance = field(default_factory=Acceptance)

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, batch_size - 1).bit_length()  # 1, 2, 4, 8, ...

    def choose(self, batch_size: int, widths: Sequence[int], drafted: Drafted = Drafted()) -> int:
        """The next round's verify width for ``batch_size`` rows: 1 (plain), or one of ``widths``
        (the drafting widths the backend runs for them, widest first; none: plain)."""
        if not widths:
            return 1
        if self.limit == "always":
            return self.width if self.width in widths else widths[0]
        if isinstance(self.limit, int):
            return widths[0] if batch_size <= self.limit else 1
        size = self.bucket(batch_size)
        b = self.buckets.setdefault(size, Bucket())
        b.decisions += 1
        b.widths = tuple(widths)
        cost = self._costs(b, drafted)
        if widths[0] in cost and 1 in cost:
            return self._best_or_probe(b, cost)
        follow = self._neighbours(size)
        first = (widths[0], 1)
        if follow is None:  # measuring: whichever has fewer rounds, drafting first
            return min(first, key=lambda w: (b.arm(w).rounds, w == 1))
        if b.decisions % self.probe_every == 0:  # following: one round in probe_every measures the other
            follow = not follow
        return widths[0] if follow else 1

    def tokens(self, width: int, arm: Arm, drafted: Drafted = Drafted()) -> float:
        """Tokens a row of ``drafted`` rows emits in a round verifying ``width`` tokens."""
        if width == 1:
            return arm.tokens_per_row
        widest = max((*self.acceptance.counts, *self.sampled_acceptance.counts), default=width)
        full = self._accepted(widest, drafted)
        scale = (drafted.accepted + PRIOR_ROUNDS * full) / max(drafted.expected + PRIOR_ROUNDS * full, 1e-9)
        return 1.0 + scale * self._accepted(width, drafted)

    def _model(self, sampled: bool) -> Acceptance:
        """The rows' class's acceptance model; the other class's until its own has rows."""
        own, other = (self.sampled_acceptance, self.acceptance) if sampled else (self.acceptance, self.sampled_acceptance)
        return own if own.rows or not other.rows else other

    def _accepted(self, width: int, drafted: Drafted) -> float:
        """Drafts a row of ``drafted``'s rows is expected to accept at ``width``: each class's
        model weighted by its rows (rows unknown: by the rows each model has recorded)."""
        if drafted.rows:
            share = drafted.sampled / drafted.rows
        else:
            seen = self.acceptance.rows + self.sampled_acceptance.rows
            share = self.sampled_acceptance.rows / seen if seen else 0.0
        greedy = self._model(False).accepted(width) if share < 1 else 0.0
        sampled = self._model(True).accepted(width) if share > 0 else 0.0
        return (1 - share) * greedy + share * sampled

    def _costs(self, b: Bucket, drafted: Drafted) -> dict[int, float]:
        """Seconds a token of each measured arm offered at the bucket."""
        return {w: b.seconds(w) / max(self.tokens(w, b.arm(w), drafted), 1e-9)
                for w in (1, *b.widths) if b.arm(w).known}

    def _best_or_probe(self, b: Bucket, cost: dict[int, float]) -> int:
        best = min(cost, key=cost.get)
        for w in b.widths[1:]:  # a narrower width not yet measured that could still win: measure it
            if w not in cost and self._could_win(b, w, cost[best]):
                return w
        # the arms take turns (the longest unrun for its schedule first), and the bucket probes
        # one whenever its rounds have taken that arm's share since the last probe of any: all
        # the probes together take about 1 / probe_every of the time, however many arms there are
        every = {w: (self.probe_every - 1) * (4 if c / max(cost[best], 1e-12) >= CLEAR_GAIN else 1)
                 * b.seconds(w) for w, c in cost.items() if w != best}
        probe = max(every, key=lambda w: b.arm(w).since / every[w], default=None)
        if probe is not None and b.spent >= every[probe]:
            b.spent = 0.0
            return probe
        return best

    def _could_win(self, b: Bucket, width: int, best: float) -> bool:
        """Whether ``width`` beats the best cost were its round as fast as the slowest measured
        arm narrower than it (no verify is faster than a narrower one, nor than a plain step)."""
        floor = max(b.seconds(w) for w in (1, *b.widths) if w < width and b.arm(w).known)
        return floor / self.tokens(width, b.arm(width)) < best

    def _choice(self, size: int) -> int | None:
        """The bucket's own choice of width once measured (for rows with no history), else None."""
        b = self.buckets[size]
        cost = self._costs(b, Drafted())
        if not b.widths or b.widths[0] not in cost or 1 not in cost:
            return None
        return min(cost, key=cost.get)

    def _neighbours(self, size: int) -> bool | None:
        """Whether the measured buckets settle drafting for an unmeasured one of ``size``
        (None: they do not)."""
        others = {s: self._choice(s) for s in self.buckets if s != size}
        if any(w is not None and w > 1 for s, w in others.items() if s > size):
            return True
        if any(w == 1 for s, w in others.items() if s < size):
            return False
        return None

    def record(self, batch_size: int, width: int, seconds: float, tokens: int, accepted: Sequence[int] = (),
               host: float | None = None, sampled: Sequence[bool] = ()) -> None:
        """A collected round of ``batch_size`` rows verifying ``width`` tokens each: its time
        (on the device, with ``host`` the host's time a round; else its share of wall time),
        the tokens its live rows emitted, the drafts each live row accepted, and whether each
        sampled (none given: all greedy)."""
        b = self.buckets.setdefault(self.bucket(batch_size), Bucket())
        if host is not None:
            b.host_times.append(host)
            b.host = statistics.median(b.host_times)
        spent = max(seconds, b.host)
        b.spent += spent
        for arm in b.arms.values():
            arm.since += spent
        b.arm(width).record(seconds, tokens / batch_size)
        if width > 1 and accepted:
            flags = list(sampled) or [False] * len(accepted)
            for model, kind in ((self.acceptance, False), (self.sampled_acceptance, True)):
                rows = [a for a, f in zip(accepted, flags) if f == kind]
                if rows:
                    model.record(width, rows)

    def expected(self, width: int, sampled: bool = False) -> float:
        """Drafts the acceptance model expects a round of ``width`` to accept for a greedy row,
        or a ``sampled`` one (0 when plain)."""
        return self._model(sampled).accepted(width) if width > 1 else 0.0

    def table(self) -> list[dict]:
        """Per batch bucket and verify width: its measured ms per token and rounds, and whether
        it is the current choice (measured or inferred; None while measuring)."""
        out = []
        for size, b in sorted(self.buckets.items()):
            choice = self._choice(size)
            if choice is None:
                follow = self._neighbours(size)
                choice = None if follow is None or not b.widths else (b.widths[0] if follow else 1)
            for width, arm in sorted((w, a) for w, a in b.arms.items() if a.rounds):
                out.append({"batch_bucket": size, "width": width, "drafting": width > 1,
                            # None until a round past its first is timed (JSON has no NaN)
                            "ms_per_token": round(b.seconds(width) / self.tokens(width, arm) * 1e3, 3)
                            if arm.times else None,
                            # the fastest of those rounds: far below the median, the median read rounds slowed by
                            # something else (the host, a transient), not the choice itself
                            "fastest_ms_per_token": round(max(min(arm.times), b.host) / self.tokens(width, arm) * 1e3, 3)
                            if arm.times else None,
                            "host_ms": round(b.host * 1e3, 3),
                            "rounds": arm.rounds, "chosen": None if choice is None else choice == width})
        return out
