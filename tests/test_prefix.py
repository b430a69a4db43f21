"""Prefix caching: blocks keyed by their tokens and all before them, pinned while used,
evicted least recently used; prompts that start alike reuse them and produce exactly what they
produce without the cache (tokens, drafts, acceptance) for every method."""

import random

import pytest

from draftline.core.engine import Engine
from draftline.core.prefix import PrefixCache
from draftline.core.sampling import SamplingParams
from draftline.core.spec import load_spec


def test_a_lookup_finds_the_longest_cached_chain_and_never_a_different_prefix():
    cache = PrefixCache(block_size=4, capacity=16)
    ids = list(range(100, 114))  # three full blocks and two tokens
    parent = None
    for i in range(3):
        parent = cache.insert(parent, tuple(ids[4 * i : 4 * i + 4]), f"block {i}")
    assert [b.payload for b in cache.lookup(ids, limit=len(ids) - 1)] == ["block 0", "block 1", "block 2"]
    assert [b.payload for b in cache.lookup(ids[:12], limit=11)] == ["block 0", "block 1"]  # a last token runs
    assert cache.lookup([7] + ids[1:], limit=13) == []  # the first block differs: nothing after it counts
    changed = ids[:4] + [0] + ids[5:]
    assert [b.payload for b in cache.lookup(changed, limit=13)] == ["block 0"]
    assert cache.stats.queries == 14 + 12 + 14 + 14 and cache.stats.hits == 12 + 8 + 0 + 4


def test_random_pin_release_and_insert_sequences_keep_the_books():
    """A property test: after any sequence of lookups, inserts and releases, pins count the
    requests holding each block, no pinned block (nor any cached block's parent) is evicted,
    the capacity holds, and releasing every request leaves nothing pinned."""
    rng = random.Random(0)
    cache = PrefixCache(block_size=2, capacity=12)
    holders: list[list] = []
    for _ in range(3000):
        if holders and rng.random() < 0.4:
            cache.release(holders.pop(rng.randrange(len(holders))))
            continue
        ids = [rng.randrange(3) for _ in range(rng.randrange(2, 12))]  # few tokens: many shared prefixes
        held = cache.lookup(ids, len(ids) - 1)
        parent = held[-1] if held else None
        for i in range(len(held), len(ids) // 2):
            parent = cache.insert(parent, tuple(ids[2 * i : 2 * i + 2]), None)
            if parent is None:
                break
            held.append(parent)
        holders.append(held)
        pins = {}
        for h in holders:
            for b in h:
                pins[id(b)] = pins.get(id(b), 0) + 1
        assert len(cache.blocks) <= 12
        assert all(b.refs == pins.get(id(b), 0) for b in cache.blocks.values())
        assert all(id(b) in {id(c) for c in cache.blocks.values()} for h in holders for b in h)  # in use: kept
        assert all(b.parent is None or cache.blocks.get(b.parent.key) is b.parent for b in cache.blocks.values())
        children = {}
        for b in cache.blocks.values():
            if b.parent is not None:
                children[id(b.parent)] = children.get(id(b.parent), 0) + 1
        assert all(b.children == children.get(id(b), 0) for b in cache.blocks.values())  # what eviction reads
    for h in holders:
        cache.release(h)
    assert all(b.refs == 0 for b in cache.blocks.values())
    with pytest.raises(RuntimeError, match="released more often"):
        cache.release(list(cache.blocks.values())[:1])


SHARED = "import os\nimport sys\n\n\ndef read_config(path):\n    with open(path) as f:\n        return f.read()\n\n\n"
SUFFIXES = ["def main():\n", "class Loader:\n", "def write_config(path, text):\n"]


@pytest.mark.parametrize("path", ["specs/tiny-dflash.yaml", "specs/tiny-eagle3.yaml", "specs/tiny-gemma4-mtp.yaml"])
def test_prompts_that_start_alike_reuse_the_cache_and_draft_exactly_as_without_it(path):
    spec = load_spec(path)
    on = Engine(spec, draft_policy="always")
    data = spec.model_dump(mode="python")
    data["server"]["enable_prefix_caching"] = False
    off = Engine(type(spec).model_validate(data), on.target, on.tokenizer, draft_policy="always")
    prompts = [SHARED + s for s in SUFFIXES]
    for params in (SamplingParams(max_new_tokens=16, ignore_eos=True),
                   SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.8, seed=7)):
        cached = [on.generate([p], params, trace=True)[0] for p in prompts]  # one at a time: each finds the last's
        plain = [off.generate([p], params, trace=True)[0] for p in prompts]
        assert [c.output_ids for c in cached] == [c.output_ids for c in plain]
        assert [c.rounds for c in cached] == [c.rounds for c in plain]  # the same drafts, accepted alike
        assert all(c.meta_info["cached_tokens"] == 0 for c in plain)
    shared = len(on.encode(SHARED)) // on.spec.server.block_size * on.spec.server.block_size
    assert shared > 0 and all(c.meta_info["cached_tokens"] >= shared for c in cached)
    assert all(b.refs == 0 for b in on.backend.prefix.blocks.values())  # finished requests pin nothing


def test_prompt_logprobs_are_computed_not_taken_from_the_cache():
    engine = Engine(load_spec("specs/tiny-none.yaml"))
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    engine.generate([SHARED + "x = 1\n"], params)
    with_lp = engine.generate([SHARED + "y = 2\n"], SamplingParams(max_new_tokens=4, ignore_eos=True, prompt_logprobs=0))
    assert with_lp[0].meta_info["cached_tokens"] == 0
    assert len([e for e in with_lp[0].prompt_logprobs if e is not None]) == len(with_lp[0].prompt_ids) - 1
    again = engine.generate([SHARED + "z = 3\n"], params)
    assert again[0].meta_info["cached_tokens"] > 0


def test_prompts_that_arrive_together_compute_their_shared_prefix_once():
    """A burst of prompts that start alike: the first computes the shared blocks, the others
    wait a step for the cache and take them from it (a prompt with nothing in common goes
    ahead of them), and every output equals the one computed without the cache."""
    spec = load_spec("specs/tiny-dflash.yaml")
    on = Engine(spec, draft_policy="always")
    data = spec.model_dump(mode="python")
    data["server"]["enable_prefix_caching"] = False
    off = Engine(type(spec).model_validate(data), on.target, on.tokenizer, draft_policy="always")
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompts = [SHARED * 3 + s for s in SUFFIXES] + ["class Other:\n    pass\n"]
    reqs = [on.add_request(p, params) for p in prompts]
    on.step()
    assert [r.phase.value for r in reqs[1:3]] == ["WAITING", "WAITING"]  # the shared blocks are being computed
    assert reqs[0].prefilled == reqs[0].prefill_len and reqs[3].prefilled == reqs[3].prefill_len
    while on.scheduler.has_work():
        on.step()
    shared = len(on.encode(SHARED * 3)) // spec.server.block_size * spec.server.block_size
    assert reqs[0].cached_tokens == 0 and all(r.cached_tokens >= shared for r in reqs[1:3])
    want = off.generate(prompts, params)
    assert [on.completion(r).output_ids for r in reqs] == [c.output_ids for c in want]
    assert not on.scheduler._keys  # nothing kept for requests that ended
