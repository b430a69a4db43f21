"""The draft policy: `auto` converges to the faster choice per batch size (plain decoding, the
full verify, or a narrower one), explores without starving it, and says what it chose."""

import random

from draftline.core.policy import Acceptance, DraftPolicy, Drafted
from draftline.core.simulated import accepted_runs

FULL = (16,)  # a backend that runs only the full verify (K = 15)
WIDTHS = (16, 8, 4, 2)  # and one that also runs narrower ones


def _run(policy: DraftPolicy, rounds: int, on: float, off: float, batch: int = 1, cold: float = 0.0) -> int:
    """Feed the policy rounds costing ``on`` / ``off`` seconds per token, a drafted round's
    rows accepting 3 drafts each (4 tokens) and a plain one's emitting 1 (the first round of
    each choice ``cold`` seconds more); -> rounds it drafted."""
    drafted, seen = 0, set()
    for _ in range(rounds):
        w = policy.choose(batch, FULL)
        d = w > 1
        cost = (on if d else off) + (cold if d not in seen else 0.0)
        seen.add(d)
        per_row = 4 if d else 1
        policy.record(batch, w, cost * per_row, per_row * batch, [3] * batch if d else [0] * batch)
        drafted += d
    return drafted


def test_auto_takes_the_faster_choice_within_a_few_rounds_and_keeps_probing():
    fast = DraftPolicy("auto")
    assert _run(fast, 100, on=1.0, off=2.0) >= 90
    slow = DraftPolicy("auto")
    drafted = _run(slow, 100, on=2.0, off=1.0)
    assert 3 <= drafted <= 12  # the measuring rounds, then one probe in 16
    assert [(r["width"], r["chosen"]) for r in slow.table() if r["batch_bucket"] == 1] == [(1, True), (16, False)]


def test_a_cold_first_round_does_not_hide_drafting():
    """The first round of a choice (graph capture, a cold cache) is not held against it."""
    policy = DraftPolicy("auto")
    assert _run(policy, 40, on=1.0, off=2.0, cold=50.0) >= 34


def test_each_batch_bucket_decides_for_itself():
    policy = DraftPolicy("auto")
    _run(policy, 60, on=1.0, off=2.0, batch=1)
    assert _run(policy, 60, on=3.0, off=1.0, batch=16) <= 10
    assert _run(policy, 20, on=1.0, off=2.0, batch=1) >= 18
    chosen = {(r["batch_bucket"], r["drafting"]): r["chosen"] for r in policy.table()}
    assert chosen[(1, True)] and chosen[(16, False)]


def test_fixed_limits():
    assert DraftPolicy("always").choose(64, WIDTHS) == 16
    assert DraftPolicy(4).choose(4, WIDTHS) == 16 and DraftPolicy(4).choose(5, WIDTHS) == 1
    assert DraftPolicy("auto").choose(1, ()) == 1  # nothing to draft with


def test_an_unmeasured_bucket_follows_the_neighbours_that_settle_it():
    """A batch shrinking through new buckets (a static batch's last requests) drafts at once
    where a larger bucket drafts, and stays plain where a smaller one does not, measuring the
    other choice only by its probes."""
    policy = DraftPolicy("auto")
    _run(policy, 60, on=1.0, off=2.0, batch=16)
    assert _run(policy, 16, on=1.0, off=2.0, batch=8) >= 15  # no measuring rounds: one probe at most
    slow = DraftPolicy("auto")
    _run(slow, 60, on=2.0, off=1.0, batch=2)
    assert _run(slow, 15, on=2.0, off=1.0, batch=4) == 0
    assert _run(slow, 15, on=2.0, off=1.0, batch=1) >= 2  # smaller than the plain bucket: measured


def test_what_drafts_are_accepted_is_learned_across_buckets_and_widths():
    """Acceptance is a property of the requests, not of the batch size: a new bucket's first
    estimate starts from what every bucket's drafted rounds accepted; and a round of any width
    tells every narrower one how far its drafts go."""
    policy = DraftPolicy("auto")
    for _ in range(20):
        policy.record(1, 16, 1.0, 4, [3])
    for _ in range(2):  # the first round of a choice is not timed
        policy.record(16, 16, 1.0, 16 * 4, [3] * 16)
    assert abs(policy.acceptance.accepted(16) - 3.0) < 1e-9 and abs(policy.acceptance.accepted(2) - 1.0) < 1e-9
    assert [r["ms_per_token"] for r in policy.table() if r["batch_bucket"] == 16 and r["drafting"]] == [250.0]
    model = Acceptance()  # half the rows accept every draft of a width-4 round, half none; width 16 says more
    model.record(4, [3, 0])
    model.record(16, [15, 0])
    assert model.conditional(4) == [0.5, 1.0, 1.0] and abs(model.accepted(16) - 7.5) < 1e-9


def test_rows_that_accept_little_turn_drafting_off_for_themselves():
    """The rows at hand weigh their own history against the model's: a request that accepted
    nothing over many rounds is served plain where the average request drafts."""
    policy = DraftPolicy("auto")
    _run(policy, 40, on=1.0, off=2.0)
    assert policy.choose(1, FULL) == 16
    hard = Drafted(accepted=0, expected=3.0 * 200)
    assert policy.tokens(16, policy.buckets[1].arm(16), hard) < 1.3
    assert sum(policy.choose(1, FULL, hard) == 1 for _ in range(10)) >= 9


def test_sampled_rows_are_judged_by_sampled_rows_acceptance():
    """Greedy and sampled requests accept drafts at different rates on the same text: a new
    sampled request is served plain at once where sampled rows accepted nothing, while a new
    greedy request still drafts on the greedy rows' evidence, and a batch of both weighs each."""
    policy = DraftPolicy("auto")
    _run(policy, 40, on=1.0, off=2.0)  # greedy rows accept 3 of 15: drafting halves a token's cost
    fresh_sampled, fresh_greedy = Drafted(rows=1, sampled=1), Drafted(rows=1, sampled=0)
    assert policy.choose(1, FULL, fresh_sampled) == 16  # no sampled round yet: the greedy rows' model stands in
    for _ in range(24):  # sampled rows accept nothing; a drafted round costs what it did
        policy.record(1, 16, 4.0, 1, [0], sampled=[True])
    assert policy.expected(16, sampled=True) == 0.0 and abs(policy.expected(16) - 3.0) < 1e-9
    assert sum(policy.choose(1, FULL, fresh_sampled) == 1 for _ in range(10)) >= 9
    assert sum(policy.choose(1, FULL, fresh_greedy) == 16 for _ in range(10)) >= 9
    arm = policy.buckets[1].arm(16)
    assert abs(policy.tokens(16, arm, Drafted(rows=4, sampled=2)) - 2.5) < 1e-9  # half the rows expect 3, half 0


def _served(policy: DraftPolicy, rounds: int, batch: int, widths: tuple[int, ...], seconds, rate: float = 0.86,
            seed: int = 0) -> tuple[float, float, dict[int, int]]:
    """Rounds whose drafts are each accepted with ``rate`` given the one before, a round of
    width w costing seconds(w) -> (tokens a row, seconds, rounds by width)."""
    rng, tokens, spent, by = random.Random(seed), 0.0, 0.0, {}
    for _ in range(rounds):
        w = policy.choose(batch, widths)
        accepted = accepted_runs(rng, batch, w, rate)
        policy.record(batch, w, seconds(w), sum(accepted) + batch, accepted)
        tokens, spent, by[w] = tokens + (sum(accepted) + batch) / batch, spent + seconds(w), by.get(w, 0) + 1
    return tokens, spent, by


def _expected(w: int, rate: float = 0.86) -> float:
    return sum(rate ** i for i in range(w))


def test_a_compute_bound_verify_narrows_to_the_fastest_width():
    """At 64 rows of the 8B shape a verify's time grows with its tokens (a 16-wide round about
    seven plain steps); τ 6.5 at the full width, 5.0 at 8, 3.2 at 4, 1.9 at 2: the policy
    settles on a width within 5% of the best tokens a second and ends within 10% of that fixed
    choice, far above the full width's and plain decoding's."""
    def seconds(w):
        return 0.006 + 0.0022 * w * (w > 1)

    rate = {w: _expected(w) / seconds(w) for w in (1, *WIDTHS)}
    best = max(rate, key=rate.get)
    assert best == 4 and rate[16] < 0.75 * rate[best] and rate[1] < 0.8 * rate[best]
    policy = DraftPolicy("auto")
    tokens, spent, by = _served(policy, 600, 64, WIDTHS, seconds)
    chosen = [r["width"] for r in policy.table() if r["chosen"]]
    assert len(chosen) == 1 and rate[chosen[0]] >= 0.95 * rate[best] and max(by, key=by.get) == chosen[0]
    assert tokens / spent >= 0.9 * rate[best]


def test_a_memory_bound_verify_keeps_the_full_width_and_measures_no_narrower_one():
    """At one row a verify of 16 tokens costs about a plain step: no narrower width could beat
    the full one even were it free, so none is measured."""
    def seconds(w):
        return 0.005 * (1.1 if w > 1 else 1.0)

    policy = DraftPolicy("auto")
    _, _, by = _served(policy, 200, 1, WIDTHS, seconds)
    assert set(by) <= {16, 1} and by[16] >= 180


def test_probes_share_one_budget_however_many_widths_there_are():
    """Four widths beside the chosen one: each probed in turn, all the probes together taking
    about a sixteenth of the time (each arm its own sixteenth spent a quarter of it probing)."""
    def seconds(w):
        return 0.006 + 0.0022 * w * (w > 1)

    policy, spent = DraftPolicy("auto"), {}
    record = policy.record

    def timed(batch, width, s, tokens, accepted=()):
        spent[width] = spent.get(width, 0.0) + s
        record(batch, width, s, tokens, accepted)

    policy.record = timed
    _, total, by = _served(policy, 2000, 64, WIDTHS, seconds)
    chosen = next(r["width"] for r in policy.table() if r["chosen"])
    assert 1 - spent[chosen] / total <= 1 / 12  # the measuring rounds, then the probes' one budget
    assert all(by.get(w, 0) >= 4 for w in (1, 16, 8) if w != chosen)  # the others still measured now and then


def test_the_table_is_json_while_a_width_is_still_measuring():
    """/spec serves the table as JSON: a width with only its untimed first round has no figure yet."""
    import json

    policy = DraftPolicy("auto")
    policy.record(1, 16, 1.0, 4, [3])
    assert json.loads(json.dumps(policy.table(), allow_nan=False))[0]["ms_per_token"] is None
    for seconds in (2.0, 1.0, 3.0):
        policy.record(1, 16, seconds, 4, [3])
    row = policy.table()[0]  # the median of the timed rounds, and the fastest beside it
    assert row["ms_per_token"] == 500.0 and row["fastest_ms_per_token"] == 250.0


def test_rounds_timed_on_the_device_cost_the_host_cycle_where_the_host_is_slower():
    """A round's device time prices its width; the host's cycle, kept for the bucket from all
    its rounds, bounds every width from below (the pipeline runs at the slower of the two).
    With a host slower than every round, the round that emits the most tokens wins."""
    def seconds(w):
        return 0.006 + 0.0022 * w * (w > 1)

    fast_host, slow_host = DraftPolicy("auto"), DraftPolicy("auto")
    for policy, host in ((fast_host, 0.001), (slow_host, 0.050)):
        record = policy.record
        policy.record = lambda b, w, s, t, a=(), record=record, host=host: record(b, w, s, t, a, host)
        _served(policy, 600, 64, WIDTHS, seconds)
    assert next(r["width"] for r in fast_host.table() if r["chosen"]) == 4  # as the device alone decides
    assert next(r["width"] for r in slow_host.table() if r["chosen"]) == 16
    row = next(r for r in slow_host.table() if r["width"] == 1)
    assert row["host_ms"] == 50.0 and row["ms_per_token"] == 50.0  # a plain round costs the host's cycle


def test_the_machine_prices_a_round_by_its_device_time_not_the_hosts_hiccups():
    """Where the backend reports a round's device time, a collect held up on the host (another
    thread holding the interpreter, a page fault) does not make that round's width look slow."""
    import time

    from draftline.core.contract import RoundResult
    from draftline.core.machine import Machine, Plan
    from draftline.core.request import Request, SpecStats
    from draftline.core.sampling import SamplingParams
    from draftline.core.scheduler import Scheduler
    from draftline.core.stops import Stops

    class Timed:
        name, max_depth, prefill_beside = "timed", 2, False

        def __init__(self):
            self.rounds = 0

        def verify_widths(self, rows):
            return (16,)

        def prefill(self, reqs, ends):
            for req, end in zip(reqs, ends):
                req.prefilled = end
            return RoundResult([True] * len(reqs), [0] * len(reqs), [[7]] * len(reqs), [[]] * len(reqs))

        def launch(self, reqs, width, then=None):
            n = len(reqs)
            return RoundResult([True] * n, [3] * n, [[7] * 4] * n, [[5] * (width - 1)] * n,
                               device_s=None if width == 1 else 0.002)

        def collect(self, handle):
            self.rounds += 1
            time.sleep(0.02 if self.rounds % 3 == 0 else 0.0)  # a hiccup every third collect
            return handle

        def free(self, req):
            pass

    scheduler, policy = Scheduler(4, 4096), DraftPolicy("always")
    machine = Machine(Plan("dflash", "parallel", 15), Timed(), scheduler, policy, Stops(lambda ids: ""), depth=2)
    for rid in range(4):
        scheduler.add(Request(rid=rid, prompt_ids=[1] * 8, params=SamplingParams(max_new_tokens=80, ignore_eos=True),
                              stop_ids=frozenset(), max_model_len=512, stats=SpecStats(15)))
    while scheduler.has_work():
        machine.step()
    arm = policy.buckets[4].arm(16)
    assert arm.rounds >= 15 and arm.seconds == 0.002  # the hiccups are not the round's
    assert 0 < policy.buckets[4].host < 0.02  # the host's cycle: most steps had none
