"""Engine behaviour: the state machine's table, slots freed and refilled, limits and bad input."""

import torch
import pytest

from conftest import tiny_spec
from draftline.core.engine import Engine, RequestError
from draftline.core.machine import TRANSITIONS, Phase, TransitionError, advance
from draftline.core.request import Request, SpecStats
from draftline.core.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny_spec(max_batch_size=2))


def test_transition_table_is_closed_and_enforced():
    assert set(TRANSITIONS) == set(Phase)
    assert all(set(nxt) <= set(Phase) for nxt in TRANSITIONS.values())
    req = Request(0, [1], GREEDY, frozenset(), 100, SpecStats(0), phase=Phase.WAITING)
    with pytest.raises(TransitionError, match="WAITING -> VERIFY"):
        advance(req, Phase.VERIFY)
    for to in (Phase.PREFILL, Phase.DRAFT, Phase.VERIFY, Phase.ACCEPT, Phase.DRAFT):
        advance(req, to)


def test_more_requests_than_slots(engine):
    prompts = ["a", "bb bb", "ccc ccc ccc", "d", "eeeee", "ff"]
    together = [c.output_ids for c in engine.generate(prompts, GREEDY)]
    alone = [engine.generate([p], GREEDY)[0].output_ids for p in prompts]
    assert together == alone and all(len(x) == 10 for x in together)
    assert not engine.scheduler.has_work()


def test_phases_after_generate(engine):
    req = engine.add_request("abc", GREEDY)
    assert req.phase is Phase.WAITING
    engine.step()  # prefill, then the first round in the same step
    assert req.phase is Phase.DRAFT and req.stats.verify_ct == 1 and req.draft_state is not None
    assert len(req.output_ids) == 1 + req.stats.round_tokens
    while engine.scheduler.has_work():
        engine.step()
    assert req.phase is Phase.FINISHED and req.kv is None and req.draft_state is None


def test_max_new_tokens_one_finishes_at_prefill(engine):
    c = engine.generate(["abc"], SamplingParams(max_new_tokens=1, ignore_eos=True))[0]
    assert len(c.output_ids) == 1 and c.meta_info["spec_verify_ct"] == 0


def test_max_model_len_is_enforced_up_front():
    short = Engine(tiny_spec(max_model_len=20))
    c = short.generate(["0123456789"], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
    assert c.meta_info["prompt_tokens"] + c.meta_info["completion_tokens"] == 20
    with pytest.raises(RequestError, match=r"exceeds max_model_len \(20\); ask for at most 10 new tokens"):
        short.generate(["0123456789"], SamplingParams(max_new_tokens=11))
    with pytest.raises(RequestError, match="max_model_len is 20"):
        short.generate(["x" * 25], GREEDY)


def test_eos_stops_unless_ignored(engine):
    eos = engine.target.config.eos_token_ids
    assert eos == (256,)
    assert set(eos) <= engine.add_request("q", SamplingParams(stop_token_ids=(7,))).stop_ids == {256, 7}
    assert engine.add_request("q", SamplingParams(ignore_eos=True, stop_token_ids=(7,))).stop_ids == {7}
    while engine.scheduler.has_work():
        engine.step()
    full = engine.generate(["q"], SamplingParams(max_new_tokens=40, ignore_eos=True))[0].output_ids
    params = SamplingParams(max_new_tokens=40, stop_token_ids=(full[3],), ignore_eos=True)
    out = engine.generate(["q"], params)[0]
    assert out.meta_info["finish_reason"] == {"type": "stop", "matched": full[3]}
    assert out.output_ids == full[: full.index(full[3]) + 1]


@pytest.mark.parametrize("prompt, match", [
    ("", "prompt is empty"),
    ([1, 2, 100000], r"input_ids must lie in \[0, 384\)"),
])
def test_bad_prompts(engine, prompt, match):
    with pytest.raises(RequestError, match=match):
        engine.generate([prompt], GREEDY)


def test_token_id_prompts(engine):
    ids = engine.encode("hello")
    assert engine.generate([ids], GREEDY)[0].output_ids == engine.generate(["hello"], GREEDY)[0].output_ids


def test_interpreted_cuda_backend_computes_in_float32_or_refuses():
    """The cuda backend on a CPU runs its kernels in the Triton interpreter, exact in float32
    only: ``auto`` takes float32 there, and an explicit half dtype is refused by name."""
    from draftline.core.engine import resolve_dtype
    from draftline.core.models.config import ConfigError

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype(tiny_spec(backend="cuda", device="cpu"), "cuda", cpu) == torch.float32
    assert resolve_dtype(tiny_spec(backend="cuda", device="cpu"), "cuda", gpu) == torch.bfloat16
    assert resolve_dtype(tiny_spec(dtype="bfloat16"), "reference", cpu) == torch.bfloat16
    for name in ("bfloat16", "float16"):
        with pytest.raises(ConfigError, match=f"model.dtype: {name} with backend: cuda on a CPU.*float32"):
            resolve_dtype(tiny_spec(backend="cuda", device="cpu", dtype=name), "cuda", cpu)


def test_a_burst_is_prefilled_within_the_token_budget_and_outputs_do_not_change():
    """server.max_num_batched_tokens bounds the prompt tokens a step prefills: a burst of
    arrivals (and a prompt longer than the budget, in chunks) is prefilled over several steps,
    between the running requests' rounds, and every output is what it is without the bound."""
    prompts = ["alpha beta gamma", "delta epsilon", "zeta eta theta iota " * 3, "kappa", "lambda mu nu xi", "omicron"]
    free = Engine(tiny_spec(max_batch_size=8))
    data = free.spec.model_dump(mode="python")
    data["server"].update(max_num_batched_tokens=10, enable_prefix_caching=False)
    bounded = Engine(type(free.spec).model_validate(data), free.target, free.tokenizer)
    reqs = [bounded.add_request(p, GREEDY) for p in prompts]
    assert max(len(r.prompt_ids) for r in reqs) > 10  # one prompt needs chunks
    steps, grew, began = [], False, {}
    while bounded.scheduler.has_work():
        before = [r.prefilled for r in reqs]
        outputs = [len(r.output_ids) for r in reqs]
        bounded.step()
        steps.append(sum(r.prefilled - b for r, b in zip(reqs, before)))
        began |= {i: len(steps) for i, r in enumerate(reqs) if r.prefilled and i not in began}
        mid = any(0 < r.prefilled < len(r.prompt_ids) for r in reqs)
        grew |= mid and any(len(r.output_ids) > n > 0 for r, n in zip(reqs, outputs))
    assert max(steps) <= 10 and sum(steps) == sum(len(r.prompt_ids) for r in reqs)
    # admitted in arrival order, over several steps
    assert [began[i] for i in range(len(reqs))] == sorted(began.values()) and len(set(began.values())) > 1
    assert grew  # running requests kept emitting while a prompt was part-way through its prefill
    assert [r.output_ids for r in reqs] == [c.output_ids for c in free.generate(prompts, GREEDY)]


def _admissions(wait: int, slots: int = 8) -> tuple[list[list[int]], int, list[int]]:
    """Greedy outputs, prefill launches and each request's steps from arrival to admission, for
    requests of different lengths through ``slots`` slots: a first wave, then one arrival every
    other step (a closed loop's trickle)."""
    spec = tiny_spec({"method": "none"}, max_batch_size=slots)
    spec = spec.model_copy(update={"server": spec.server.model_copy(update={"admission_wait": wait})})
    engine = Engine(spec)
    params = [SamplingParams(max_new_tokens=4 + 3 * (i % 5), ignore_eos=True) for i in range(24)]
    prompts = [f"def f{i}(x):\n    return x * {i}" for i in range(24)]
    reqs, waited, arrived = [], {}, {}
    step = 0
    while len(reqs) < 24 or engine.scheduler.has_work():
        for _ in range(slots if step == 0 else step % 2):
            if len(reqs) < 24:
                reqs.append(engine.add_request(prompts[len(reqs)], params[len(reqs)]))
                arrived[reqs[-1].rid] = step
        engine.step()
        step += 1
        for r in engine.scheduler.running:
            waited.setdefault(r.rid, step - 1 - arrived[r.rid])
    return [r.output_ids for r in reqs], engine.machine.clock.prefills, list(waited.values())


def test_admissions_wait_to_be_prefilled_together_and_no_longer_than_the_setting():
    """server.admission_wait: arrivals while others run are admitted together (fewer prefill
    launches), none waits past its slot's wait, and every output is what it would be at once."""
    at_once, launches, waited = _admissions(0)
    grouped, fewer, waited_grouped = _admissions(3)
    assert grouped == at_once
    assert fewer < launches
    assert max(waited_grouped) >= 1  # some did wait for company
    assert all(w <= max(waited) + 3 for w in waited_grouped)  # within the setting's steps of a free slot
