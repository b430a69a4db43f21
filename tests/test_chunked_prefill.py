"""Chunked prefill (the reference backend): a prompt longer than server.max_num_batched_tokens
is prefilled over several steps, beside running requests and a prefix cache, and every method
emits and drafts exactly what it does with the prompt prefilled whole."""

import pytest

from draftline.core.engine import Engine
from draftline.core.sampling import SamplingParams
from draftline.core.spec import load_spec

LONG = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(12))
SHORT = ["import os\n", "class A:\n"]


@pytest.mark.parametrize("path, temperature", [("specs/tiny-dflash.yaml", 0.0), ("specs/tiny-eagle3.yaml", 0.0),
                                               ("specs/tiny-gemma4-mtp.yaml", 0.0), ("specs/tiny-dflash.yaml", 0.8)])
def test_a_long_prompt_in_chunks_drafts_and_emits_as_prefilled_whole(path, temperature):
    """Greedy, and seeded sampling (draws keyed by seed and position, so the chunking must
    leave every draw where it was)."""
    spec = load_spec(path)
    whole = Engine(spec, draft_policy="always")
    data = spec.model_dump(mode="python")
    data["server"]["max_num_batched_tokens"] = 24
    chunked = Engine(type(spec).model_validate(data), whole.target, whole.tokenizer, draft_policy="always")
    assert len(chunked.encode(LONG)) > 3 * 24  # four chunks at least
    probe = chunked.add_request(LONG, SamplingParams(max_new_tokens=1, ignore_eos=True))
    chunked.step()
    assert 0 < probe.prefilled <= 24 and not probe.output_ids  # one chunk, no token yet
    while chunked.scheduler.has_work():
        chunked.step()
    assert probe.prefilled == len(probe.prompt_ids) and len(probe.output_ids) == 1
    chunked.backend.prefix.blocks.clear()  # the comparison below starts cold, as `whole` does
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=temperature, seed=11)
    for engine in (whole, chunked):  # the same prompts twice: the second pass also meets the prefix cache
        runs = [engine.generate(SHORT + [LONG], params, trace=True) for _ in range(2)]
        engine.runs = runs
    for a, b in zip(whole.runs, chunked.runs):
        assert [c.output_ids for c in a] == [c.output_ids for c in b]
        assert [c.rounds for c in a] == [c.rounds for c in b]
    assert chunked.runs[1][2].meta_info["cached_tokens"] > 0
    if temperature:  # the draws were sampled, not the greedy tokens
        greedy = whole.generate(SHORT + [LONG], SamplingParams(max_new_tokens=12, ignore_eos=True))
        assert [c.output_ids for c in greedy] != [c.output_ids for c in whole.runs[0]]


def test_a_request_cancelled_part_way_through_its_prefill_leaves_nothing_behind():
    spec = load_spec("specs/tiny-dflash.yaml")
    data = spec.model_dump(mode="python")
    data["server"]["max_num_batched_tokens"] = 16
    engine = Engine(type(spec).model_validate(data), draft_policy="always")
    req = engine.add_request(LONG, SamplingParams(max_new_tokens=4, ignore_eos=True))
    other = engine.add_request("import os\n", SamplingParams(max_new_tokens=4, ignore_eos=True))
    engine.step()
    engine.step()
    assert 0 < req.prefilled < len(req.prompt_ids)
    req.cancelled = True
    while engine.scheduler.has_work():
        engine.step()
    assert req.finish_reason["type"] == "abort" and "cancelled" in req.finish_reason["message"]
    assert len(other.output_ids) == 4 and not engine.backend._chunks  # its chunks' features are gone
    assert all(b.refs == 0 for b in engine.backend.prefix.blocks.values())
