"""Holding a request out of new rounds near its length limit (Stops.done_in_flight), with
rounds in flight: only when those rounds surely end it, so that its stream never waits depth +
1 steps for a round it was denied. And, on the same stand-in device, what the machine tells the
draft policy a round cost."""

import random
import time

from draftline.core.contract import RoundResult
from draftline.core.machine import Machine, Plan
from draftline.core.policy import DraftPolicy
from draftline.core.request import Request, SpecStats
from draftline.core.sampling import SamplingParams
from draftline.core.scheduler import Scheduler
from draftline.core.simulated import accepted_runs
from draftline.core.stops import Stops


def _request(rid: int, max_new: int, prompt: int = 8, max_model_len: int = 512, out: int = 0) -> Request:
    req = Request(rid=rid, prompt_ids=[1] * prompt, params=SamplingParams(max_new_tokens=max_new, ignore_eos=True),
                  stop_ids=frozenset(), max_model_len=max_model_len, stats=SpecStats(7))
    req.output_ids = [7] * out
    for _ in range(4):  # rounds that accepted much: their mean would call the request done early
        req.stats.record(7, 7)
    return req


def test_rounds_in_flight_hold_a_request_only_when_they_surely_end_it():
    assert Stops.done_in_flight(_request(0, 10, out=8), 2)  # two rounds emit two tokens at least
    assert not Stops.done_in_flight(_request(0, 10, out=7), 2)  # three left: two rounds of 8 would do, likely
    assert not Stops.done_in_flight(_request(0, 10, out=7), 0)
    assert Stops.done_in_flight(_request(0, 100, prompt=20, max_model_len=30, out=9), 1)  # the context's end
    assert not Stops.done_in_flight(_request(0, 100, prompt=20, max_model_len=30, out=8), 1)


class Device:
    """Rounds that accept a seeded random run each, returned at collect (two in flight)."""

    name, max_depth, prefill_beside = "stand-in", 2, False

    def __init__(self):
        self.rng = random.Random(0)

    def verify_widths(self, rows):
        return (8,)

    def prefill(self, reqs, ends):
        for req, end in zip(reqs, ends):
            req.prefilled = end
        return RoundResult([True] * len(reqs), [0] * len(reqs), [[7]] * len(reqs), [[]] * len(reqs))

    def launch(self, reqs, width, then=None):
        accepted = accepted_runs(self.rng, len(reqs), width, 0.8)
        return RoundResult([True] * len(reqs), accepted, [[7] * (a + 1) for a in accepted],
                           [[5] * (width - 1)] * len(reqs))

    def collect(self, handle):
        return handle

    def free(self, req):
        pass


class Noted(Stops):
    def __init__(self, steps):
        super().__init__(lambda ids: "")
        self.steps, self.arrived = steps, {}

    def apply(self, req, tokens):
        kept = super().apply(req, tokens)
        self.arrived.setdefault(req.rid, []).append(self.steps())
        return kept


def test_with_two_rounds_in_flight_a_stream_gets_tokens_every_step_to_its_end():
    """Twelve requests of mixed lengths through four slots, rounds accepting at random: each
    gets its tokens at every step from its prefill to its last, ends at its exact length, and
    some were held out of a round at their end."""
    scheduler = Scheduler(4, 4096)
    holder = []
    stops = Noted(lambda: holder[0].steps)
    machine = Machine(Plan("dflash", "parallel", 7), Device(), scheduler, DraftPolicy("always"), stops, depth=2)
    holder.append(machine)
    lengths = [17, 40, 9, 63, 25, 31, 12, 50, 8, 44, 29, 36]
    reqs = [Request(rid=i, prompt_ids=[1] * 8, params=SamplingParams(max_new_tokens=n, ignore_eos=True),
                    stop_ids=frozenset(), max_model_len=512, stats=SpecStats(7)) for i, n in enumerate(lengths)]
    for req in reqs:
        scheduler.add(req)
    held = 0
    while scheduler.has_work():
        before = list(machine.flights)
        machine.step()
        held += sum(f.held for f in machine.flights if not any(f is b for b in before))
    assert [len(r.output_ids) for r in reqs] == lengths
    gaps = [b - a for steps in stops.arrived.values() for a, b in zip(steps, steps[1:])]
    assert held > 0 and max(gaps) == 1


class Timed(Device):
    """Rounds timed on the device at a microsecond each, the host taking 2 ms between them."""

    def launch(self, reqs, width, then=None):
        time.sleep(0.002)
        result = super().launch(reqs, width, then)
        return RoundResult(result.finite, result.accepted, result.tokens, result.drafted, device_s=1e-6)


class Grammar:
    def advance(self, tokens):
        pass


def test_a_constrained_round_is_priced_by_the_wall_since_the_last_collect():
    """A constrained request's round waits for the host to book the one before it, and the
    backend's device span for it starts where its part run ahead did: the draft policy prices it
    by the wall time since the previous collect, not by that span; other rounds by their device
    time (with the host's cycle)."""
    for grammar, cheap in ((None, True), (Grammar(), False)):
        scheduler, policy = Scheduler(1, 4096), DraftPolicy("always")
        priced = []
        record = policy.record

        def timed(batch, width, seconds, *rest, record=record, priced=priced):
            priced.append(seconds)
            record(batch, width, seconds, *rest)
        policy.record = timed
        machine = Machine(Plan("dflash", "parallel", 7), Timed(), scheduler, policy, Stops(lambda ids: ""), depth=2)
        req = _request(0, 40)
        req.grammar = grammar
        scheduler.add(req)
        while scheduler.has_work():
            machine.step()
        assert priced and all((s < 1e-3) == cheap for s in priced), priced
