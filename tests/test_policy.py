"""The draft policy: `auto` converges to the faster choice per batch size, explores without
starving it, and says what it chose."""

from draftline.core.policy import DraftPolicy


def _run(policy: DraftPolicy, rounds: int, on: float, off: float, batch: int = 1, cold: float = 0.0) -> int:
    """Feed the policy rounds costing ``on`` / ``off`` seconds per token (the first round of
    each choice ``cold`` seconds more); -> rounds it drafted."""
    drafted, seen = 0, set()
    for _ in range(rounds):
        d = policy.should_draft(batch)
        cost = (on if d else off) + (cold if d not in seen else 0.0)
        seen.add(d)
        policy.record(batch, d, cost * 4, 4)
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
