"""The pacer: a step's prefill, while other requests decode, bounded to server.max_prefill_stall
rounds' time as this machine measured a round and a prompt token (core/pacer.py)."""

import time

import pytest

from draftline.core.contract import RoundResult
from draftline.core.machine import Machine, Plan
from draftline.core.pacer import Pacer
from draftline.core.policy import DraftPolicy
from draftline.core.request import Request, SpecStats
from draftline.core.sampling import SamplingParams
from draftline.core.scheduler import Scheduler
from draftline.core.stops import Stops

FIXED, PER_TOKEN, ROUND = 0.004, 3e-5, 0.014  # seconds: a prefill's launch, a prompt token, a round


def test_the_pacer_prices_a_prompt_token_and_bounds_a_steps_prefill():
    pacer = Pacer(1.5)
    assert pacer.budget(8192) == 8192  # nothing measured yet: the spec's bound alone
    for tokens in (128, 256, 512, 128):
        pacer.prefilled(tokens, FIXED + PER_TOKEN * tokens)
    pacer.rounded(ROUND)
    assert pacer.cost() == pytest.approx((FIXED, PER_TOKEN))
    assert pacer.budget(8192) == int((1.5 * ROUND - FIXED) / PER_TOKEN)  # 566 tokens: 1.5 rounds' time
    assert pacer.budget(300) == 300  # never above the spec's bound
    pacer.rounded(0.0001), pacer.rounded(0.0001)  # rounds far cheaper than a prefill's launch
    assert pacer.budget(8192) == 128  # a step may always take a 128-token prompt
    assert Pacer(None).budget(8192) == 8192


def test_prefills_of_one_size_are_priced_per_token():
    pacer = Pacer(2.0)
    pacer.prefilled(512, 0.02), pacer.prefilled(512, 0.02)
    pacer.rounded(0.01)
    assert pacer.cost() == (0.0, 0.02 / 512)
    assert pacer.budget(8192) == 512


class Priced:
    """A synchronous stand-in device whose prefills cost FIXED + PER_TOKEN a prompt token and
    whose rounds cost ROUND, as its device clock reports them."""

    name, max_depth, prefill_beside = "stand-in", 0, False

    def __init__(self):
        self.groups: list[int] = []  # prompts in each prefill launch

    def verify_widths(self, rows):
        return (8,)

    def prefill(self, reqs, ends):
        tokens = sum(end - req.prefilled for req, end in zip(reqs, ends))
        for req, end in zip(reqs, ends):
            req.prefilled = end
        self.groups.append(len(reqs))
        n = len(reqs)
        return RoundResult([True] * n, [0] * n, [[7]] * n, [[]] * n, device_s=FIXED + PER_TOKEN * tokens)

    def launch(self, reqs, width, then=None):
        n = len(reqs)
        return RoundResult([True] * n, [0] * n, [[7]] * n, [[5] * (width - 1)] * n, device_s=ROUND)

    def collect(self, handle):
        return handle

    def free(self, req):
        pass


def _requests(first: int, n: int) -> list[Request]:
    return [Request(rid=first + i, prompt_ids=[1] * 128, params=SamplingParams(max_new_tokens=40, ignore_eos=True),
                    stop_ids=frozenset(), max_model_len=512, stats=SpecStats(7)) for i in range(n)]


@pytest.mark.parametrize("stall, groups", [(1.5, [4, 4, 4]), (None, [4, 8])])
def test_a_burst_beside_decoding_streams_is_prefilled_over_steps(stall, groups):
    """Four requests start together (nothing decodes: one prefill), then eight arrive while they
    decode: within 1.5 rounds' time a step prefills four 128-token prompts (about 19 ms beside
    14-ms rounds), so the burst takes two steps; unbounded, one prefill of all eight."""
    device = Priced()
    scheduler = Scheduler(16, 8192, pacer=Pacer(stall))
    machine = Machine(Plan("dflash", "parallel", 7), device, scheduler, DraftPolicy("always"), Stops(lambda ids: ""))
    first, burst = _requests(0, 4), _requests(4, 8)
    for req in first:
        scheduler.add(req)
    for _ in range(3):
        machine.step()
    for req in burst:
        scheduler.add(req)
    while scheduler.has_work():
        machine.step()
    assert device.groups == groups
    assert all(len(r.output_ids) == 40 for r in first + burst)


class Untimed(Priced):
    """A synchronous device that times nothing (the reference backend): the prefill's work is done
    inside its launch, which the machine must count."""

    def prefill(self, reqs, ends):
        time.sleep(0.01)
        result = super().prefill(reqs, ends)
        return RoundResult(result.finite, result.accepted, result.tokens, result.drafted)

    def launch(self, reqs, width, then=None):
        result = super().launch(reqs, width, then)
        return RoundResult(result.finite, result.accepted, result.tokens, result.drafted)


def test_an_untimed_synchronous_prefill_is_priced_by_its_launch():
    scheduler = Scheduler(4, 8192, pacer=Pacer(1.5))
    machine = Machine(Plan("dflash", "parallel", 7), Untimed(), scheduler, DraftPolicy("always"), Stops(lambda ids: ""))
    for req in _requests(0, 2):
        scheduler.add(req)
    machine.step()
    assert [t for t, _ in scheduler.pacer.prefills] == [256]
    assert scheduler.pacer.prefills[0][1] >= 0.01
