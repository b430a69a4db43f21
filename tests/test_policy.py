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


def _timed(policy: DraftPolicy, rounds: int, on_round: float, off_round: float, tau: float, batch: int = 1
           ) -> tuple[float, float, float]:
    """Rounds of fixed cost (``on_round`` seconds a drafting round, whose rows emit ``tau``
    tokens each; ``off_round`` a plain one) -> (seconds drafting, seconds plain, tokens a row)."""
    spent, tokens = {True: 0.0, False: 0.0}, 0.0
    for _ in range(rounds):
        d = policy.should_draft(batch)
        per_row = tau if d else 1.0
        policy.record(batch, d, on_round if d else off_round, per_row * batch)
        spent[d] += on_round if d else off_round
        tokens += per_row
    return spent[True], spent[False], tokens


def test_a_probe_takes_a_share_of_the_time_not_of_the_rounds():
    """A drafting round eight times a plain one's (64 rows verifying 16 tokens each), plain
    1.27x faster a token: probing drafting one round in 16 spent a third of the time on it
    (0.9 of plain decoding's speed); by time it spends about a sixteenth, within 5% of plain."""
    policy = DraftPolicy("auto")
    drafting, plain, tokens = _timed(policy, 4000, on_round=0.050, off_round=0.006, tau=6.6, batch=64)
    assert drafting / (drafting + plain) <= 1 / 12  # the measuring rounds, then about a 16th
    assert tokens / (drafting + plain) >= 0.95 / 0.006  # against plain decoding's tokens a second
    fast = DraftPolicy("auto")  # the other way round: drafting faster, plain probed by its own (short) rounds
    drafting, plain, tokens = _timed(fast, 400, on_round=0.026, off_round=0.006, tau=6.6, batch=32)
    assert plain / (drafting + plain) <= 1 / 15 and tokens / (drafting + plain) >= 0.95 * 6.6 / 0.026


def test_a_clear_winner_is_probed_less_often_than_a_close_one():
    clear, close = DraftPolicy("auto"), DraftPolicy("auto")
    _, plain_clear, _ = _timed(clear, 2000, on_round=4.0, off_round=2.0, tau=4.0)  # drafting 2x faster a token
    _, plain_close, _ = _timed(close, 2000, on_round=4.0, off_round=1.2, tau=4.0)  # 1.2x
    total_clear, total_close = 2000 * 4.0, 2000 * 4.0  # about: nearly every round drafts
    assert plain_clear / total_clear <= 1 / 60 + 0.002  # the measuring rounds, then about a 64th of the time
    assert 1 / 20 <= plain_close / total_close <= 1 / 14  # about a 16th
