"""What each captured prefill costs on the device, measured at start-up, and how a group of
prompts is split among those graphs at least cost.

A prefill group's rows are padded to a batch bucket (1, 2, 4, ... rows) so that it replays a
graph, and padding rows cost what real ones do: on the 8B shape, once the forward is bound by
arithmetic, 17 prompts padded to 32 rows take about as long as 32 do, far longer than groups of
8, 8 and 1 (docs/RESULTS.md, prefill rows). A small model's forward is bound by its launches instead
(a 16-row graph costs what a 2-row one does), where splitting would only add launches. So the
choice is made from each graph's measured device time, not from a rule about padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable

from .graphs import Graphs

LAUNCH_MS = 1.0  # the host's work for one more prefill launch, as measured on an H200's host
SPLIT_GAIN = 0.9  # a split must save a tenth of the one padded forward: no splitting on the timings' noise


@dataclass(frozen=True)
class PrefillPrices:
    # (rows bucket, width, later) -> device ms of one replay of that prefill graph
    ms: dict[Hashable, float] = field(default_factory=dict)
    _memo: dict[tuple[int, int, bool], list[int]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def measure(cls, graphs: Graphs, device_index: int, pad: Callable[[Hashable], None]) -> "PrefillPrices":
        """One timed replay of every captured prefill graph, each over padding rows (``pad``
        writes them for its key: the scratch slot)."""
        ms = {}
        for key in graphs.keys():
            pad(key)
            ms[key] = graphs.replay_ms(key, device_index)
        return cls(ms)

    def pieces(self, rows: int, width: int, later: bool) -> list[int]:
        """How many of a group's ``rows`` chunks (at most ``width`` tokens) each forward takes,
        largest first: the split whose graphs' measured times, plus LAUNCH_MS a launch, sum least,
        where that costs under SPLIT_GAIN of the one padded forward; else [rows], as when no
        measured graph holds them all. Remembered per (rows, width, later): a prefill asks every step."""
        key = (rows, width, later)
        if key not in self._memo:
            self._memo[key] = self._cheapest(rows, width, later)
        return self._memo[key]

    def _cheapest(self, rows: int, width: int, later: bool) -> list[int]:
        cost = {b: ms + LAUNCH_MS for (b, w, late), ms in self.ms.items() if w == width and late == later}
        if rows <= 1 or not any(b >= rows for b in cost):
            return [rows]
        best = [(0.0, 0)]  # best[m]: (the cheapest split's cost for m rows, its first forward's bucket)
        for m in range(1, rows + 1):
            best.append(min((best[max(0, m - b)][0] + c, b) for b, c in cost.items()))
        one = min(c for b, c in cost.items() if b >= rows)
        if best[rows][0] >= SPLIT_GAIN * one:
            return [rows]
        pieces, m = [], rows
        while m > 0:
            pieces.append(min(best[m][1], m))
            m -= best[m][1]
        return sorted(pieces, reverse=True)
