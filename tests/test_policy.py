"""The draft policy: `auto` converges to the faster choice per batch size, explores without
starving it, and says what it chose."""

from draftline.core.policy import DraftPolicy


def _run(policy: DraftPolicy, rounds: int, on: float, off: float, batch: int = 1, cold: float = 0.0) -> int:
    """Feed the policy rounds costing ``on`` / ``off`` seconds per token, a drafted round's
    rows emitting 4 tokens each and a plain one's 1 (the first round of each choice ``cold``
    seconds more); -> rounds it drafted."""
    drafted, seen = 0, set()
    for _ in range(rounds):
        d = policy.should_draft(batch)
        cost = (on if d else off) + (cold if d not in seen else 0.0)
        seen.add(d)
        per_row = 4 if d else 1
        policy.record(batch, d, cost * per_row, per_row * batch)
        drafted += d
    return drafted


def test_auto_takes_the_faster_choice_within_a_few_rounds_and_keeps_probing():
    fast = DraftPolicy("auto")
    assert _run(fast, 100, on=1.0, off=2.0) >= 90
    slow = DraftPolicy("auto")
    drafted = _run(slow, 100, on=2.0, off=1.0)
    assert 3 <= drafted <= 12  # the measuring rounds, then one probe in 16
    assert [r["chosen"] for r in slow.table() if r["batch_bucket"] == 1] == [True, False]


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
    assert DraftPolicy("always").should_draft(64)
    assert DraftPolicy(4).should_draft(4) and not DraftPolicy(4).should_draft(5)


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


def test_the_tokens_a_drafted_row_emits_are_learned_across_buckets():
    """Drafting's tokens a row are a property of the requests, not of the batch size: a new
    bucket's first estimate starts from what every bucket's drafted rounds emitted."""
    policy = DraftPolicy("auto")
    for _ in range(20):
        policy.record(1, True, 1.0, 4)
    for _ in range(2):  # the first round of a choice is not timed
        policy.record(16, True, 1.0, 16 * 4)
    assert abs(policy.drafting.tokens_per_row - 4.0) < 1e-9
    assert [r["ms_per_token"] for r in policy.table() if r["batch_bucket"] == 16 and r["drafting"]] == [250.0]


def test_a_clear_winner_is_probed_less_often_than_a_close_one():
    clear, close = DraftPolicy("auto"), DraftPolicy("auto")
    plain_clear = 256 - _run(clear, 256, on=1.0, off=2.0)
    plain_close = 256 - _run(close, 256, on=1.0, off=1.2)
    assert plain_clear <= 3 + 256 // 64 + 1  # the measuring rounds, then one probe in 64
    assert plain_close >= 256 // 16 - 1  # one probe in 16
