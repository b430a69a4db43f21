"""Admission and preemption by KV blocks: requests are admitted while the pool's blocks last;
when the running requests' next rounds need more, the newest is preempted, and finishes
later with exactly the output it would have had; nothing is lost, and a request that can never
fit is refused up front."""

import random

import pytest

from conftest import argmax_drafts, tiny_spec
from draftline.core.engine import Engine, RequestError, kv_blocks, kv_lookahead
from draftline.core.machine import Phase
from draftline.core.sampling import SamplingParams
from draftline.core.spec import load_spec

PROMPTS = ["def f(x):", "import os\nclass A:\n    def run(self, n):", "x = [", "for i in range(10):\n    print(i)"]


def _with_server(engine: Engine, **server) -> Engine:
    data = engine.spec.model_dump(mode="python")
    data["server"] |= server
    return Engine(type(engine.spec).model_validate(data), engine.target, engine.tokenizer, draft_policy="always")


def _tight(engine: Engine, block_size: int, prompts: list[str], new: int) -> int:
    """A pool every request fits alone, but too small for all of them to run to their end."""
    data = engine.spec.model_dump(mode="python")
    data["server"]["block_size"] = block_size
    pool = kv_blocks(type(engine.spec).model_validate(data), kv_lookahead(engine.plan, engine.machine.depth))
    longest = max(pool.most(len(engine.encode(p)), new) for p in prompts)
    return longest + longest // 2


@pytest.mark.parametrize("path", ["specs/tiny-dflash.yaml", "specs/tiny-eagle3.yaml", "specs/tiny-gemma4-mtp.yaml"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_preempted_requests_emit_what_they_emit_unpreempted(path, temperature):
    """Argmax drafts: a preempted request's recomputed drafter state may round its q apart, which
    a draft sampled from q would follow."""
    free = Engine(argmax_drafts(load_spec(path)), draft_policy="always")
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=temperature, seed=11)
    want = free.generate(PROMPTS, params)
    assert all(c.meta_info["preemptions"] == 0 for c in want)  # the default pool holds every whole context
    tight = _with_server(free, block_size=8, num_kv_blocks=_tight(free, 8, PROMPTS, 24))
    got = tight.generate(PROMPTS, params)
    assert sum(c.meta_info["preemptions"] for c in got) > 0
    assert [c.output_ids for c in got] == [c.output_ids for c in want]
    assert tight.machine.clock.preemptions == sum(c.meta_info["preemptions"] for c in got)


def test_a_request_that_can_never_fit_the_pool_is_refused_up_front():
    engine = Engine(tiny_spec({"method": "none"}))
    small = _with_server(engine, block_size=4, num_kv_blocks=6)
    with pytest.raises(RequestError, match="num_kv_blocks"):
        small.add_request("x" * 40, SamplingParams(max_new_tokens=8))
    small.add_request("x", SamplingParams(max_new_tokens=8))  # 1 + 8 + 1 lookahead: 3 blocks
    # a prompt scored without new tokens still draws a first one: counted, so it runs
    scored = small.add_request("x" * 7, SamplingParams(max_new_tokens=0, prompt_logprobs=0))
    while small.scheduler.has_work():
        small.step()
    assert scored.finish_reason["type"] == "length"


def test_the_newest_request_past_its_prefill_is_preempted_first_and_never_the_oldest():
    from types import SimpleNamespace

    from draftline.core.blocks import BlockPool

    def req(rid, prompt, made, prefilled):
        return SimpleNamespace(rid=rid, prefill_len=prompt, seq_len=prompt + made, prefilled=prefilled)

    pool = BlockPool(size=4, total=10, lookahead=0)
    old, decoding, chunking = req(0, 8, 7, 8), req(1, 8, 3, 8), req(2, 12, 0, 4)  # 4 + 3 + 4 blocks
    assert pool.victims([old, decoding, chunking]) == [decoding]  # not the newer one part-way through its chunks
    assert pool.victims([old, chunking]) == []
    assert pool.victims([req(0, 40, 1, 40)]) == []  # alone, the oldest always runs on


def test_random_arrivals_and_cancels_keep_the_pool_within_its_blocks_and_lose_nothing():
    """A property test: whenever a round is launched, the requests not yet freed (a paged
    cache's pages are held until then: those cancelled or ended this step too) hold at most
    the pool's blocks; the oldest running request is never the one preempted; every request
    ends: at its length, or aborted when cancelled."""
    rng = random.Random(3)
    engine = _with_server(Engine(tiny_spec({"method": "none"}, max_batch_size=6)), block_size=4, num_kv_blocks=24)
    pool, reqs, launches = engine.blocks, [], []
    launch = engine.backend.launch

    def checked(rows, width, then=None):
        launches.append(sum(pool.demand(r) for r in engine.scheduler.running))  # reaped: freed
        return launch(rows, width, then)

    engine.backend.launch = checked
    for step in range(400):
        if rng.random() < 0.3 and len(reqs) < 40:
            n = rng.randrange(1, 30)
            reqs.append(engine.add_request([rng.randrange(2, 200) for _ in range(n)],
                                           SamplingParams(max_new_tokens=rng.randrange(1, 40), ignore_eos=True)))
        if reqs and rng.random() < 0.05:
            rng.choice(reqs).cancelled = True
        before = {r.rid: r.preemptions for r in engine.scheduler.running if r.phase is not Phase.FINISHED}
        engine.step()
        preempted = [r.rid for r in reqs if r.rid in before and r.preemptions > before[r.rid]]
        assert min(before, default=None) not in preempted  # the oldest runs on
    while engine.scheduler.has_work():
        engine.step()
    assert launches and max(launches) <= pool.total
    assert reqs and all(r.phase is Phase.FINISHED for r in reqs)
    for r in reqs:
        if r.finish_reason["type"] != "abort":
            assert len(r.output_ids) == r.params.max_new_tokens
    assert sum(r.preemptions for r in reqs) > 0


def test_a_preempted_request_does_not_count_against_the_queue():
    """server.max_queue bounds the requests not yet admitted: a preempted one was accepted."""
    engine = _with_server(Engine(tiny_spec({"method": "none"}, max_batch_size=4)), block_size=4, num_kv_blocks=8)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    reqs = [engine.add_request("ab", params) for _ in range(3)]
    for _ in range(100):  # three requests of 2 + 12 + 1 tokens (4 blocks each) in 8 blocks
        engine.step()
        if any(r.preemptions for r in reqs):
            break
    waiting = list(engine.scheduler.waiting)
    assert any(r.preemptions for r in waiting)
    assert engine.scheduler.queued() == sum(1 for r in waiting if not r.preemptions)
    while engine.scheduler.has_work():
        engine.step()
    assert all(len(r.output_ids) == 12 for r in reqs)
