"""A prefill group's split among the captured prefill graphs, by their measured device times
(backends/cuda/prices.py)."""

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton (other modules' kernels)
pytest.importorskip("triton")

from draftline.backends.cuda.prices import LAUNCH_MS, PrefillPrices  # noqa: E402

# device ms of a 128-wide first-chunk prefill graph by its rows, as an H200 measured the 8B shape
ARITHMETIC_BOUND = {1: 7.1, 2: 11.4, 4: 18.7, 8: 37.0, 16: 78.5, 32: 138.0, 64: 300.0}
LAUNCH_BOUND = {1: 0.20, 2: 0.20, 4: 0.21, 8: 0.22, 16: 0.24, 32: 0.27, 64: 0.31}  # a tiny model's


def _prices(table: dict[int, float], width: int = 128, later: bool = False) -> PrefillPrices:
    return PrefillPrices({(rows, width, later): ms for rows, ms in table.items()})


def test_an_arithmetic_bound_forward_runs_full_buckets_rather_than_padding():
    prices = _prices(ARITHMETIC_BOUND)
    assert prices.pieces(17, 128, False) == [8, 8, 1]  # 37 + 37 + 7.1 + 3 launches, against 138 + 1
    assert prices.pieces(38, 128, False) == [32, 4, 2]  # against 300 for 64 rows
    assert prices.pieces(16, 128, False) == [16]  # 8 + 8 saves under a tenth: not worth the noise
    assert prices.pieces(3, 128, False) == [3]  # 18.7 padded, against 11.4 + 7.1 + a launch


def test_a_launch_bound_forward_stays_one_padded_launch():
    prices = _prices(LAUNCH_BOUND)
    assert [prices.pieces(n, 128, False) for n in (3, 17, 38)] == [[3], [17], [38]]


def test_what_was_not_measured_is_not_split():
    prices = _prices(ARITHMETIC_BOUND)
    assert prices.pieces(17, 256, False) == [17]  # no graph of that width
    assert prices.pieces(17, 128, True) == [17]  # later chunks' graphs unmeasured
    assert _prices({1: 7.1, 16: 78.5}).pieces(17, 128, False) == [17]  # no bucket holds 17 rows
    assert PrefillPrices().pieces(5, 16, False) == [5]  # graphs off: nothing measured


def test_the_split_is_the_cheapest():
    """Against every split into bucket-sized pieces (brute force over small row counts)."""
    prices = _prices(ARITHMETIC_BOUND)

    def cost(pieces):
        return sum(min(ms for b, ms in ARITHMETIC_BOUND.items() if b >= p) + LAUNCH_MS for p in pieces)

    @functools.cache
    def cheapest(n):
        if n == 0:
            return 0.0
        return min(ARITHMETIC_BOUND[b] + LAUNCH_MS + cheapest(max(0, n - b)) for b in ARITHMETIC_BOUND)

    for n in range(1, 40):
        pieces, one = prices.pieces(n, 128, False), cost([n])
        assert sum(pieces) == n
        assert cost(pieces) == pytest.approx(cheapest(n) if cheapest(n) < 0.9 * one else one)
