"""The cuda backend held to the reference backend. On a GPU it runs with graphs (and the
`gpu`-marked checks add bf16 and graph-vs-eager comparisons); without one it runs eagerly on
the CPU through the Triton interpreter, so CI checks its buffers, static caches, windows and
kernels end to end."""

import functools
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
pytest.importorskip("triton")

from conftest import INTERPRETED, argmax_drafts, respec, tiny_spec  # noqa: E402
from draftline.core.engine import Engine, kv_blocks, kv_lookahead  # noqa: E402
from draftline.core.sampling import SamplingParams  # noqa: E402
from draftline.core.spec import load_spec  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log")  # log(0) = -inf, by design
PROMPTS = ["def f(x):", "import os\nclass A:\n    def run(self, n):", "x = [", "for i in range(10):\n    print(i)"]
METHODS = {"none": {"method": "none"},
           # block 5: the interpreter runs every kernel program in Python, so keep windows short
           "dflash": {"method": "dflash", "draft": {"random_init": {"preset": "tiny-dflash", "seed": 1}},
                      "block_size": 5},
           "eagle3": {"method": "eagle3", "draft": {"random_init": {"preset": "tiny-eagle3", "seed": 1}},
                      "num_speculative_tokens": 3},
           "gemma4_mtp": {"method": "gemma4_mtp", "draft": {"random_init": {"preset": "tiny-mtp", "seed": 1}},
                          "num_speculative_tokens": 3}}


def _engine(method: str, backend: str, depth: int | str = "auto", slots: int = 4, **model) -> Engine:
    model = {"max_model_len": 128, **model}  # short caches: fewer attention splits to interpret on a CPU
    spec = tiny_spec(METHODS[method], max_batch_size=slots, backend=backend, device=DEV, dtype="float32", **model)
    return Engine(with_depth(spec, depth))


def with_depth(spec, depth: int | str):
    data = spec.model_dump(mode="python")
    data["server"]["pipeline_depth"] = depth
    return type(spec).model_validate(data)


def _same_rounds(ref, got) -> None:
    for r, g in zip(ref, got):
        assert g.output_ids == r.output_ids
        assert [x.accepted for x in g.rounds] == [x.accepted for x in r.rounds]


@pytest.mark.parametrize("method", ["none", "dflash"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_tokens_equal_reference(method, batch):
    """float32: identical greedy tokens and identical accepted counts, mixed prompt lengths,
    with two rounds in flight behind the one the host books."""
    # 6 tokens: the random drafter's drafts are rarely accepted, so about 5 rounds, each of the
    # later ones launched with two ahead (every round is interpreted kernel by kernel on a CPU)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ref = _engine(method, "reference").generate(PROMPTS[:batch], params, trace=True)
    eng = _engine(method, "cuda", depth=2)
    _same_rounds(ref, eng.generate(PROMPTS[:batch], params, trace=True))
    assert eng.machine.depth == 2 and eng.machine.clock.ahead > 0  # rounds were launched ahead of the host


@pytest.mark.parametrize("method_name", ["eagle3", "gemma4_mtp"])
@pytest.mark.parametrize("draft, batch", [("greedy", 1), ("probabilistic", 4)])
def test_chain_methods_equal_reference(method_name, batch, draft):
    """EAGLE-3 (its head entries written by position: the window's in the verify step, the last
    verified one in the draft step) and the frozen-KV MTP drafter (reading the target's static
    cache and the backend's last verified features): identical tokens and accepted counts,
    greedy (the graph-captured path) and with sampled drafts (drafted eagerly, seeded, rows of
    different lengths and seeds), both launched ahead of the host. Greedy rounds over several
    rows are the trained drafters' and the in-flight stops' tests below (depths 0, 1 and 2)."""
    # 6 tokens: about 5 rounds at depth 1 (the random drafters' drafts are rarely accepted)
    params = [SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.0 if draft == "greedy" else 1.0,
                             seed=7 + i) for i in range(batch)]
    method = {**METHODS[method_name], "draft_sample_method": draft}
    specs = [tiny_spec(method, max_batch_size=4, backend=b, device=DEV, dtype="float32", max_model_len=128)
             for b in ("reference", "cuda")]
    ref = Engine(specs[0]).generate(PROMPTS[:batch], params, trace=True)
    eng = Engine(with_depth(specs[1], 1))
    _same_rounds(ref, eng.generate(PROMPTS[:batch], params, trace=True))
    assert eng.machine.clock.ahead > 0


@pytest.mark.parametrize("method", ["none", "dflash", "eagle3", "gemma4_mtp"])
def test_rows_that_stop_while_rounds_are_in_flight(method):
    """Requests ending at different rounds (length limits, EOS) and a queue admitting new ones
    into freed slots, two rounds in flight: what a round in flight computed for a request that
    has stopped is ignored, and tokens still equal the reference's; no slot leaks. A request
    admitted into the running batch (its prefill still in flight) joins the batch's rounds:
    each step launches one round for every request that can take one, never a group of its
    own that would stay apart."""
    # lengths: the first ends early and frees a slot while the longest (7) still runs, so the
    # fifth joins its rounds; the one of length 5 may stop at EOS
    params = [SamplingParams(max_new_tokens=n, ignore_eos=n != 5) for n in (3, 7, 4, 5, 2, 4)]
    ref = _engine(method, "reference").generate(PROMPTS + PROMPTS[:2], params)
    eng = _engine(method, "cuda", depth=2)
    reqs = [eng.add_request(p, s) for p, s in zip(PROMPTS + PROMPTS[:2], params)]  # six through four slots
    joined, held = False, 0
    while eng.scheduler.has_work():
        before = list(eng.machine.flights)
        eng.step()
        new = [f for f in eng.machine.flights if not f.prefill and not any(f is b for b in before)]
        assert len(new) <= 1  # one round a step
        joined |= any(any(r is reqs[4] for r in f.reqs) and len(f.reqs) > 1 for f in new)
        held += sum(f.held for f in new)  # rows whose rounds in flight should end them sat this step out
    assert joined  # a request admitted later ran in the others' rounds
    assert held > 0
    assert [r.output_ids for r in reqs] == [r.output_ids for r in ref]
    assert eng.machine.clock.ahead > 0 and not eng.machine.flights
    assert sorted(eng.backend.cache.slots.free) == [0, 1, 2, 3] and sorted(eng.backend.kv.slots.free) == [0, 1, 2, 3]


@pytest.mark.parametrize("method", ["dflash", "eagle3"])
def test_rows_prefilled_beside_the_rounds_join_from_the_next_step(method, monkeypatch):
    """Prefills beside the rounds (DRAFTLINE_PREFILL_BESIDE=1; on a GPU their own stream, on a
    CPU the machine's side of it): a request admitted while others run never rides the round
    launched in its prefill's step, joins the others' rounds from a later step, and every token
    equals the reference's, with two rounds in flight and slots reused."""
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 7, 4, 5, 2, 4)]
    ref = _engine(method, "reference").generate(PROMPTS + PROMPTS[:2], params)
    monkeypatch.setenv("DRAFTLINE_PREFILL_BESIDE", "1")
    eng = _engine(method, "cuda", depth=2)
    assert eng.backend.prefill_beside == (DEV == "cuda")  # a stream of its own needs a GPU
    eng.backend.prefill_beside = True  # the machine's side of it, on a CPU too
    reqs = [eng.add_request(p, s) for p, s in zip(PROMPTS + PROMPTS[:2], params)]  # six through four slots
    joined, beside = False, 0
    while eng.scheduler.has_work():
        before = list(eng.machine.flights)
        eng.step()
        new = [f for f in eng.machine.flights if not any(f is b for b in before)]
        fresh = {id(r) for f in new if f.prefill for r in f.reqs}
        for f in (f for f in new if not f.prefill):
            riding = [r for r in f.reqs if id(r) in fresh]
            assert not riding or len(riding) == len(f.reqs)  # only when nothing else runs (the first wave)
            beside += bool(fresh) and not riding
            joined |= any(r is reqs[4] for r in f.reqs) and len(f.reqs) > 1
    assert beside and joined  # a round ran beside a prefill; a later request then joined the others
    assert [r.output_ids for r in reqs] == [r.output_ids for r in ref]
    assert not eng.machine.flights and sorted(eng.backend.cache.slots.free) == [0, 1, 2, 3]


TRAINED = {"dflash": "specs/tiny-dflash.yaml", "eagle3": "specs/tiny-eagle3.yaml",
           "gemma4_mtp": "specs/tiny-gemma4-mtp.yaml"}


def _trained_spec(method: str):
    """The shipped spec with argmax drafts (the shipped specs sample their drafts, which greedy
    requests draft as their argmax anyway): the reference's drafts then come from the same head."""
    return argmax_drafts(load_spec(TRAINED[method]))
TRAINED_PROMPTS = ["import os\nclass A:\n    def run(self, n):", "def add(a, b):\n    ",
                   "for i in range(10):\n    print(i)", "def __init__(self, name):\n"]
TRAINED_LENGTHS = (8, 5, 6, 4)  # a few rounds each: the trained drafters' runs are long


@functools.cache
def _trained_reference(method: str, batch: int) -> tuple:
    spec = respec(_trained_spec(method), "reference", max_batch_size=4, device=DEV, dtype="float32",
                  max_model_len=128)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in TRAINED_LENGTHS][:batch]
    return tuple(Engine(spec, draft_policy="always").generate(TRAINED_PROMPTS[:batch], params, trace=True))


@pytest.mark.parametrize("method, batch, depth", [("dflash", 1, 2), ("eagle3", 4, 1), ("gemma4_mtp", 4, 0),
                                                  ("dflash", 4, 0), ("eagle3", 1, 2), ("gemma4_mtp", 1, 1)])
def test_trained_drafters_accept_the_same_drafts(method, batch, depth):
    """The shipped trained drafters, whose drafts are often accepted: the pipeline takes the
    reference's rounds exactly (the drafter's static context, its graph-safe update, the
    target's KV past accepted runs, the state each round leaves). Two cases per method keep
    the interpreter's time in bounds: each method at batch 1 and 4 (of mixed lengths) and two
    depths, every depth for two methods (the random-weight tests above run every method at
    depth 1 or 2 too). The DFlash case
    takes the spec's default kernels, the batch-invariant ones, also under the interpreter."""
    ref = _trained_reference(method, batch)
    assert sum(x.accepted for c in ref for x in c.rounds) >= 2 * batch  # drafts were accepted: the check has teeth
    default = {"batch_invariant": None} if method == "dflash" else {}
    spec = respec(_trained_spec(method), "cuda", max_batch_size=4, device=DEV, dtype="float32", max_model_len=128,
                  **default)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in TRAINED_LENGTHS][:batch]
    eng = Engine(with_depth(spec, depth), draft_policy="always")
    _same_rounds(ref, eng.generate(TRAINED_PROMPTS[:batch], params, trace=True))
    assert eng.machine.depth == depth
    assert eng.backend.cache.invariant == (method == "dflash" or not INTERPRETED)


class _Narrow:
    """A draft policy that verifies ``width`` tokens where the backend offers it (the full width
    elsewhere): the rounds a compute-bound batch would take under ``auto``."""

    def __init__(self, width: int):
        self.width = width

    def choose(self, batch_size, widths, drafted=None) -> int:
        return self.width if self.width in widths else widths[0]

    def record(self, *args) -> None:
        pass

    def expected(self, width: int, sampled: bool = False) -> float:
        return 0.0


@pytest.mark.parametrize("method, width, paged", [("dflash", 4, False), ("eagle3", 2, False), ("dflash", 8, True)])
def test_a_narrower_verify_accepts_as_the_reference_and_emits_the_full_widths_tokens(method, width, paged,
                                                                                      monkeypatch):
    """Rounds that verify only their first drafts (the backend's narrower widths, offered here
    at 4 rows whatever their verify's tokens), over static slots or 4-token pages: the cuda
    backend takes the reference's rounds at that width exactly, every round verifies ``width``
    tokens, and greedy output is the full width's, token for token (lossless)."""
    from draftline.backends.cuda import backend as cuda_backend

    monkeypatch.setattr(cuda_backend, "NARROW_TOKENS", 0)
    full = _trained_reference(method, 4)
    spec = respec(_trained_spec(method), "reference", max_batch_size=4, device=DEV, dtype="float32",
                  max_model_len=128)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in TRAINED_LENGTHS]
    cuda = with_depth(respec(_trained_spec(method), "cuda", max_batch_size=4, device=DEV, dtype="float32",
                             max_model_len=128), 2)
    server = {"block_size": 4, "num_kv_blocks": 160} if paged else {"enable_prefix_caching": False}  # else static
    cuda = cuda.model_copy(update={"server": cuda.server.model_copy(update=server)})
    engines = [Engine(spec), Engine(cuda)]
    outs, chains = [], []
    propose = engines[1].backend.drafter.propose

    def counted(reqs, rows):
        out = propose(reqs, rows)
        chains.append(out.tokens.shape[1])
        return out

    engines[1].backend.drafter.propose = counted
    for eng in engines:
        assert width in eng.backend.verify_widths(4)
        eng.machine.policy = _Narrow(width)
        outs.append(eng.generate(TRAINED_PROMPTS, params, trace=True))
    ref, got = outs
    # a chain stops after the drafts the round verifies; a block drafter reads out only those slots.
    # Counted where rounds run eagerly (the interpreter): a replayed graph runs no Python, and
    # it captured this same step
    if not engines[1].backend.graphs.enabled:
        assert set(chains) == {width - 1}
    assert sum(x.accepted for c in ref for x in c.rounds) >= 4  # drafts were accepted: the check has teeth
    assert {len(x.drafted) for c in ref for x in c.rounds} == {width - 1}
    _same_rounds(ref, got)
    assert [c.output_ids for c in got] == [c.output_ids for c in full]
    assert (engines[1].backend.cache.pager is not None) == paged


def test_seeded_sampling_repeats_and_batches_alike():
    """Sampling keyed by (seed, position): a request gives the same tokens alone, in a batch
    and run again (each run alone is the batch's request run again, in another slot)."""
    params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=4, ignore_eos=True) for s in (3, 4)]
    eng = _engine("dflash", "cuda")
    batch = eng.generate(PROMPTS[:2], params)
    alone = [eng.generate([p], s)[0] for p, s in zip(PROMPTS[:2], params)]
    assert [c.output_ids for c in batch] == [c.output_ids for c in alone]
    assert batch[0].output_ids != batch[1].output_ids  # seeds matter


def test_slots_are_reused_after_requests_finish():
    eng = _engine("dflash", "cuda", slots=2)  # two slots: each is used twice by four requests
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[2]] * 2  # short prompts: each prefill is interpreted too
    first = eng.generate(prompts, params)  # 4 requests through 2 slots
    assert len(first) == 4 and all(len(c.output_ids) == 4 for c in first)
    assert sorted(eng.backend.cache.slots.free) == [0, 1]
    assert eng.generate(prompts[:1], params)[0].output_ids == first[0].output_ids


def test_probabilistic_drafting_draws_inside_the_round_and_filtered_rows_eagerly():
    """With draft_sample_method probabilistic, rounds of greedy rows draft the drafter's argmax
    (what a draw from their one-hot q is) inside the round's graph path; rounds with a row at
    temperature 1 draw from q and take the rejection rule inside it too (a greedy row beside it
    included); rows with top-p draw and accept eagerly. Each gets the reference's tokens, and repeats under its seed, before and
    after start-up's warm sampled rounds."""
    spec = {**METHODS["dflash"], "draft_sample_method": "probabilistic"}
    engines = [Engine(tiny_spec(spec, max_batch_size=2, backend=backend, device=DEV, dtype="float32", max_model_len=128))
               for backend in ("reference", "cuda")]
    backend, rounds, drawn = engines[1].backend, [], []
    replay, propose = backend._replay, backend.drafter.propose

    def spied(bucket, width, decide, drafts_inside, sampled=False):
        if width > 1:
            rounds.append((drafts_inside, sampled))
        return replay(bucket, width, decide, drafts_inside, sampled)

    def run(params, n=1) -> list:
        rounds.clear()
        drawn.clear()
        ref, got = (e.generate(PROMPTS[:n], params) for e in engines)
        assert [c.output_ids for c in got] == [c.output_ids for c in ref]
        return [c.output_ids for c in got]

    backend._replay = spied
    backend.drafter.propose = lambda reqs, rows: drawn.append(not rows.greedy) or propose(reqs, rows)
    greedy = SamplingParams(max_new_tokens=5, ignore_eos=True)  # about 4 rounds: each is interpreted
    first_greedy = run(greedy, 2)
    assert rounds and all(r == (True, False) for r in rounds) and not any(drawn)
    sampled = SamplingParams(temperature=1.0, seed=9, max_new_tokens=5, ignore_eos=True)
    first = run(sampled)
    assert rounds and all(r == (True, True) for r in rounds) and all(drawn)  # drawn from q, inside
    run([greedy, sampled], 2)  # a greedy row beside a sampling one: its q and p one-hot in the same graph
    assert rounds and all(r == (True, True) for r in rounds)
    filtered = SamplingParams(temperature=1.0, top_p=0.9, seed=9, max_new_tokens=5, ignore_eos=True)
    run(filtered)
    assert rounds and all(r == (False, False) for r in rounds) and all(drawn)  # drawn eagerly
    for n in (1, 2):  # start-up's sampled rounds (a GPU's, to compile their eager path) leave nothing behind
        backend._warm_sampled(n)
    assert run(sampled) == first
    assert run(greedy, 2) == first_greedy


def _stops_in_flight_match_depth_0(engine_at, prompts: list[str], n: int) -> list:
    """A length limit, a stop id and a stop string, the last two picked where the request's own
    rounds run on past them, a request ending by EOS or length, and one cancelled mid-stream, with
    two rounds in flight (depth 2) and with none (depth 0, made by ``engine_at(depth)``); ``n``
    scales the lengths. Every request but the cancelled one gets exactly the synchronous run's
    tokens, text and finish reason, every slot comes back, and nothing stays in flight. Returns
    the piped run's requests (traced)."""
    runs = []
    for depth in (0, 2):
        eng = engine_at(depth)
        alone = eng.generate([prompts[0]], SamplingParams(max_new_tokens=2 * n, ignore_eos=True), trace=True)[0]
        stop_id, stop = _stops_inside_rounds(eng, alone)
        reqs = [eng.add_request(prompts[0], SamplingParams(max_new_tokens=n, ignore_eos=True), trace=True),
                eng.add_request(prompts[0], SamplingParams(max_new_tokens=2 * n, stop_token_ids=(stop_id,)),
                                trace=True),
                eng.add_request(prompts[0], SamplingParams(max_new_tokens=2 * n), trace=True, stop=[stop]),
                eng.add_request(prompts[1], SamplingParams(max_new_tokens=2 * n), trace=True),
                eng.add_request(prompts[2], SamplingParams(max_new_tokens=4 * n, ignore_eos=True), trace=True)]
        for _ in range(2):
            eng.step()
        reqs[-1].cancelled = True  # a client gone while its rounds run
        while eng.scheduler.has_work():
            eng.step()
        runs.append([eng.completion(r) for r in reqs])
        assert not eng.machine.flights and sorted(eng.backend.cache.slots.free) == [0, 1, 2, 3]
        assert eng.machine.depth == depth
    sync, piped = runs
    assert [c.meta_info["finish_reason"]["type"] for c in piped[:3]] == ["length", "stop", "stop"]
    assert piped[4].meta_info["finish_reason"]["type"] == "abort"
    assert piped[2].meta_info["finish_reason"]["matched"] == sync[2].meta_info["finish_reason"]["matched"]
    for a, b in zip(sync[:4], piped[:4]):
        assert a.output_ids == b.output_ids and a.text == b.text and a.meta_info["finish_reason"] == b.meta_info["finish_reason"]
    return reqs


def _stops_inside_rounds(eng: Engine, alone) -> tuple[int, str]:
    """A stop id and a stop string that a traced completion emits first at a token its round
    ran on past (not a round's last token), three tokens in at least: the id, a token's id not
    seen before; the string, the text a token adds (decodable, not in the text before it)."""
    first = len(alone.output_ids) - sum(len(r.emitted) for r in alone.rounds)  # the prefill's token
    inside, at = [], first
    for r in alone.rounds:
        inside += [i for i in range(at, at + len(r.emitted) - 1) if i >= 3]
        at += len(r.emitted)
    ids = alone.output_ids
    stop_id = next(ids[i] for i in inside if ids[i] not in ids[:i])
    texts = [eng.tokenizer.decode(ids[:i], skip_special_tokens=True) for i in range(len(ids) + 1)]
    added = [(texts[i], texts[i + 1][len(texts[i]):]) for i in inside if texts[i + 1].startswith(texts[i])]
    return stop_id, next(new for before, new in added if new and "\ufffd" not in new and new not in before)


@pytest.mark.gpu  # the trained pair's 16-token windows take the interpreter past 20 minutes here
def test_stops_and_cancellation_in_flight_equal_the_synchronous_run():
    """The trained pair's own drafts: rounds accept what the drafter gets right."""
    spec = respec(_trained_spec("dflash"), "cuda", max_batch_size=4, device=DEV, dtype="float32",
                  max_model_len=128)
    _stops_in_flight_match_depth_0(lambda depth: Engine(with_depth(spec, depth), draft_policy="always"),
                                   TRAINED_PROMPTS, 9)


def test_stops_and_cancellation_in_flight_with_accepted_drafts_equal_the_synchronous_run():
    """The same on a CPU: the tiny random pair's 5-token blocks, their drafts replaced by the
    target's own continuation made wrong at one place a round (bench --acceptance's override,
    rate 0.8), so rounds accept several tokens, and the stop id and the stop string each cut a
    round short."""
    from draftline.core.simulated import SimulatedAcceptance

    prompts = PROMPTS[1:] + PROMPTS[:1]
    reference = _engine("none", "reference").generate(prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))
    continuations, engines = {}, []

    def engine_at(depth: int) -> Engine:
        eng = _engine("dflash", "cuda", depth=depth)
        continuations.update({tuple(eng.encode(p)): c.output_ids for p, c in zip(prompts, reference)})
        eng.backend.set_draft_override(SimulatedAcceptance(0.8, continuations, 4, eng.backend.cache.max_len,
                                                           eng.target.config.vocab_size, eng.device))
        engines.append(eng)
        return eng

    piped = _stops_in_flight_match_depth_0(engine_at, prompts, 6)
    by_id, by_string = piped[1:3]
    last = by_id.rounds[-1]
    assert len(last.emitted) < last.accepted + 1  # the stop id cut its round's tokens short
    # the stop string cuts the text, not the round's tokens: its round emitted text past the match
    eng, stop = engines[-1], by_string.finish_reason["matched"]
    full, text = eng.tokenizer.decode(by_string.output_ids, skip_special_tokens=True), eng.text(by_string)
    assert full.startswith(text + stop) and len(full) > len(text + stop)


@pytest.mark.parametrize("method", ["none", "eagle3"])
def test_capture_over_padding_rows_moves_no_state(method):
    """Capture runs a round's step for real (twice, then once recorded), so a step over padding
    rows only must leave every slot's state as it was and give the same result again; over a
    live row the same step moves that row's state past its emitted tokens."""
    eng = _engine(method, "cuda", depth=0)
    req = eng.add_request(PROMPTS[1], SamplingParams(max_new_tokens=8, ignore_eos=True))
    eng.step()  # prefill, and one round
    backend, width = eng.backend, eng.backend.width
    inside = width > 1
    state = backend.bufs.state.clone()
    backend.bufs.load([], 2)
    runs = [backend._round_step(2, width, True, inside)[1].clone() for _ in range(2)]
    assert torch.equal(runs[0], runs[1]) and torch.equal(backend.bufs.state, state)
    backend.bufs.load([req], 1)
    packed = backend._round_step(1, width, True, inside)[1].cpu()
    assert int(backend.bufs.state[1, req.kv]) == int(state[1, req.kv]) + int(packed[0, 1]) + 1
    assert int(backend.bufs.state[0, req.kv]) == int(packed[0, 2 + packed[0, 1]])


def test_settle_flags_rows_with_non_finite_logits():
    """The verify graph decides on the device: a row with any non-finite logit (counted by the
    draw kernel, chunk by chunk) is flagged for the host, the others are decided as usual and
    their slots step on past the emitted token."""
    eng = _engine("none", "cuda", depth=0)  # no round in flight moves the rows' state after the step
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=8, ignore_eos=True)) for p in PROMPTS[:3]]
    eng.step()
    backend = eng.backend
    backend.bufs.load(reqs, 4)
    backend.bufs.gather(4)
    vocab = backend.target.lm_head.weight.shape[0]
    logits = torch.randn(4, 1, vocab, generator=torch.Generator().manual_seed(0)).to(DEV)
    logits[1, 0, vocab - 2] = float("nan")  # in the last chunk
    logits[2, 0, 0] = float("-inf")
    start = backend.bufs.state[1, reqs[0].kv].item()
    packed = backend._decide(4, 1, logits, False).cpu()
    assert packed[:3, 0].tolist() == [1, 0, 0]
    assert packed[0, 1] == 0 and packed[0, 2] == logits[0, 0].argmax().item()  # greedy, no drafts
    state = backend.bufs.state[:, reqs[0].kv].cpu()
    assert state[0] == packed[0, 2] and state[1] == start + 1 == reqs[0].seq_len


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_settle_accepts_from_the_heads_draws_as_from_the_logits(temperature):
    """A head that folded its draws (matvec_draw) leaves raw draws and non-finite counts in the
    scratch; the settle takes them and accepts drafts while they match. The packed result and
    each row's new state are those of the draw kernels' path."""
    from draftline.backends.cuda import sampling as kernels
    from draftline.backends.cuda.buffers import INV_TEMP, SEED, START
    from draftline.backends.cuda.matvec import EMPTY

    eng = _engine("none", "cuda", depth=0)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=temperature, seed=i))
            for i, p in enumerate(PROMPTS[:3])]
    eng.step()
    backend, b = eng.backend, eng.backend.bufs
    width = b.drafts.shape[1] + 1
    b.load(reqs, 4)
    b.gather(4)
    vocab = backend.target.lm_head.weight.shape[0]
    logits = torch.randn(4, width, vocab, generator=torch.Generator().manual_seed(1)).to(DEV)
    logits[2, width - 1, 5] = float("inf")
    rows = torch.arange(4 * width, device=DEV)
    req, t = rows // width, rows % width
    draws = kernels.sample(logits.view(4 * width, vocab), b.row(SEED, 4)[req], b.row(START, 4)[req] + 1 + t,
                           inv_temp=b.fmeta[INV_TEMP, :4][req]).view(4, width)
    drafts = draws[:, : width - 1].clone()
    drafts[0, -1] += 1  # row 0 accepts all but its last draft, row 1 all of them, row 2 none
    drafts[2, 0] += 1
    b.drafts[:4, : width - 1] = drafts
    counts = (~torch.isfinite(logits)).sum(-1).view(-1)
    slots = [r.kv for r in reqs]
    outcomes = []
    for drawn in (False, True):
        if drawn:  # as the head's matvec_draw leaves them
            b.argmax.best[: 4 * width] = (1 << 32) - 1 - draws.view(-1)  # a winner's value bits are not read
            b.argmax.bad[: 4 * width] = counts.int()
        packed = backend._decide(4, width, logits, drawn).cpu()
        outcomes.append((packed, b.state[:, slots].cpu().clone()))
    assert bool((b.argmax.best == EMPTY).all()) and not bool(b.argmax.bad.any())  # taken
    assert torch.equal(*[o[0] for o in outcomes]) and torch.equal(*[o[1] for o in outcomes])
    assert outcomes[0][0][:3, :2].tolist() == [[1, width - 2], [1, width - 1], [0, 0]]


def test_branch_work_is_done_at_the_join_eagerly_and_in_a_graph():
    """overlap.Branch: what runs under fork() is done once the step's stream passes join(), in
    a captured graph too; a join with nothing forked leaves a capture intact (a verify step
    without a drafter joins, and waiting on the side stream's earlier uncaptured work would
    break the capture)."""
    from draftline.backends.cuda.overlap import Branch

    branch, x = Branch(torch.device(DEV)), torch.arange(8.0, device=DEV)
    side, main = torch.zeros(8, device=DEV), torch.zeros(8, device=DEV)

    def step():
        branch.join()  # nothing forked yet: must not touch the side stream
        with branch.fork():
            side.copy_(x * x + 1)
        main.copy_(x * 2)
        branch.join()

    step()
    assert torch.equal(side, x * x + 1) and torch.equal(main, x * 2)
    if DEV == "cuda":
        side.zero_()
        main.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        x.add_(1)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(side, x * x + 1) and torch.equal(main, x * 2)


def test_simulated_acceptance_gives_the_profiles_tau():
    """bench --acceptance on a tiny random pair (whose own drafts are never accepted): with
    drafts replaced inside the draft step, the measured tau is the profile's, within 0.7
    (about two standard errors over these ~16 rounds, where drafts left as the random
    drafter's give tau near 1, 1.8 below; the draws are keyed, so the run is deterministic),
    and tokens stay the target's."""
    from draftline.core.simulated import SimulatedAcceptance, expected_tau

    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompts = PROMPTS[:2]
    # the reference's continuation: the cuda backend's own, as the differential tests hold
    longer = _engine("none", "reference").generate(prompts, SamplingParams(max_new_tokens=32, ignore_eos=True))
    eng = _engine("dflash", "cuda", depth=2)
    eng.backend.set_draft_override(SimulatedAcceptance(
        0.7, {tuple(eng.encode(p)): c.output_ids for p, c in zip(prompts, longer)}, 4, eng.backend.cache.max_len,
        eng.target.config.vocab_size, eng.device))
    got = eng.generate(prompts, params)
    assert [c.output_ids for c in got] == [c.output_ids[:24] for c in longer]
    tau = sum(c.meta_info["completion_tokens"] - 1 for c in got) / sum(c.meta_info["spec_verify_ct"] for c in got)
    assert abs(tau - expected_tau(0.7, 4)) < 0.7, tau


@pytest.mark.parametrize("field, value, feature", [
    ("frequency_penalty", 0.5, "penalties"), ("logit_bias", ((5, 1.0),), "penalties"), ("min_new_tokens", 3, "penalties"),
    ("logprobs", 2, "logprobs"), ("prompt_logprobs", 0, "prompt_logprobs")])
def test_features_a_backend_lacks_are_refused_not_run_differently(field, value, feature):
    """The cuda backend runs every feature a request can ask; a backend that lacked one would
    name it and run nothing, rather than emit tokens the request did not ask for."""
    from draftline.core.engine import RequestError

    engine = _cuda_none()
    params = SamplingParams(max_new_tokens=4, **{field: value})
    assert engine.make_request(PROMPTS[0], params).params == params
    offered = engine.backend.features
    try:
        engine.backend.features = offered - {feature}
        with pytest.raises(RequestError, match=f"cuda backend does not implement {feature}"):
            engine.make_request(PROMPTS[0], params)
    finally:
        engine.backend.features = offered


@functools.cache
def _cuda_none() -> Engine:
    return _engine("none", "cuda")


def _reference_window(reqs, logits, drafts):
    """The reference's round over these logits and drafts (draftline.core.penalties, draftline.core.sampling)."""
    from draftline.core.penalties import adjust_logits
    from draftline.core.sampling import SamplingBatch, accept_drafts, probs_from_logits

    batch = SamplingBatch.of([r.params for r in reqs])
    probs = probs_from_logits(adjust_logits(logits, reqs, drafts), batch)
    first = torch.tensor([r.seq_len for r in reqs])
    return accept_drafts(probs, drafts, None, batch.seed, first, batch.temperature == 0)


def test_a_window_is_adjusted_slot_by_slot_as_the_reference_adjusts_it():
    """Penalties, logit_bias and min_new_tokens inside a verify window: each slot sees the
    device's counts of the row's output plus the window's earlier drafts, and min_new_tokens
    holds a stop id back only at the slots before it is reached. The round's verdict equals
    the reference's over the same logits and drafts, and the emitted tokens are counted."""
    from draftline.core.penalties import adjust_logits

    eng = _engine("dflash", "cuda", depth=0)
    eos = eng.target.config.eos_token_ids[0]
    params = [SamplingParams(max_new_tokens=16, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3,
                             logit_bias=((eos, 30.0),), min_new_tokens=5),  # EOS wins at the window's last slot
              SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.8, seed=5, frequency_penalty=2.0),
              SamplingParams(max_new_tokens=16, ignore_eos=True)]  # adjusts nothing, in the same round
    reqs = [eng.make_request(p, s) for p, s in zip(PROMPTS[:3], params)]
    backend, b, width = eng.backend, eng.backend.bufs, eng.backend.width
    first = backend.collect(backend.prefill(reqs))  # each first token, counted on the device
    for r, tokens in zip(reqs, first.tokens):
        r.append(tokens)
    for r in reqs[:2]:
        want = torch.bincount(torch.tensor(r.output_ids), minlength=backend.penalties.vocab).float()
        assert torch.equal(backend.penalties.counts[r.kv].cpu(), want)
    vocab = backend.penalties.vocab
    logits = torch.randn(3, width, vocab, generator=torch.Generator().manual_seed(3))  # the reference's, on the CPU
    drafts = torch.zeros(3, width - 1, dtype=torch.int64)
    for j in range(width - 1):  # greedy drafts the adjusted window accepts; the others' first draft fails
        drafts[:, j] = adjust_logits(logits[:, : j + 1], reqs, drafts[:, :j])[:, j].argmax(-1)
    drafts[2, 0] = (drafts[2, 0] + 1) % vocab
    want = _reference_window(reqs, logits, drafts)
    assert eos not in drafts[0].tolist() and want.tokens[0, width - 1] == eos  # held back until min_new_tokens
    with torch.inference_mode():  # as a launch runs it
        b.load(reqs, 4)
        b.gather(4)
        b.drafts[:3, : width - 1] = drafts.to(DEV)
        packed = backend._accept(reqs, width, logits.to(DEV), None).cpu()
    assert packed[:, 1].tolist() == want.num_accepted.tolist()
    for i, r in enumerate(reqs):
        emitted = want.tokens[i, : int(want.num_accepted[i]) + 1].tolist()
        assert packed[i, 2 : 3 + int(packed[i, 1])].tolist() == emitted
        if i < 2:
            counted = torch.bincount(torch.tensor(r.output_ids + emitted), minlength=vocab).float()
            assert torch.equal(backend.penalties.counts[r.kv].cpu(), counted)
    assert int(want.num_accepted[0]) == width - 1


def test_penalties_and_logprobs_with_rounds_in_flight_equal_the_reference():
    """Plain decoding with two rounds in flight: penalised rows (greedy and seeded sampled,
    beside a row that adjusts nothing) emit the reference's tokens, and the target's logprobs
    (output and prompt) are the reference's."""
    eos = 256
    params = [SamplingParams(max_new_tokens=5, frequency_penalty=1.2, presence_penalty=0.4, repetition_penalty=1.2,
                             logit_bias=((eos, 20.0), (7, 3.0)), min_new_tokens=4, logprobs=2, prompt_logprobs=1),
              SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0.8, seed=11, frequency_penalty=1.0,
                             logprobs=0),
              SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=3)]
    ref = _engine("none", "reference").generate(PROMPTS[:3], params)
    eng = _engine("none", "cuda", depth=2)
    assert eng.target.config.eos_token_ids[0] == eos
    got = eng.generate(PROMPTS[:3], params)
    assert [c.output_ids for c in got] == [c.output_ids for c in ref]
    assert got[0].output_ids[-1] == eos and len(got[0].output_ids) == 5  # min_new_tokens held EOS back
    assert got[0].meta_info["finish_reason"]["type"] == "stop"
    assert eng.machine.clock.ahead > 0
    _same_logprobs(ref, got)


def _same_logprobs(ref, got) -> None:
    """Output and prompt logprobs of ``got`` are the reference's: tokens, values, alternatives."""
    for r, g in zip(ref, got):
        pairs = list(zip(r.logprobs, g.logprobs)) + list(zip(r.prompt_logprobs or [], g.prompt_logprobs or []))[1:]
        assert len(pairs) >= len(r.output_ids)
        for a, c in pairs:
            assert c.token == a.token and c.logprob == pytest.approx(a.logprob, abs=1e-4)
            assert [t for t, _ in c.top] == [t for t, _ in a.top]
            assert [v for _, v in c.top] == pytest.approx([v for _, v in a.top], abs=1e-4)


def test_logprobs_and_penalties_through_chunks_and_prefix_hits_equal_the_reference():
    """Rows reporting logprobs and adjusting logits, prefilled in chunks of at most 6 tokens and
    (the second time, and the third prompt the first time) from the prefix cache's blocks, beside one asking prompt logprobs (which
    neither chunks nor meets the cache): tokens and logprobs are the reference's."""
    shared = "import os\nimport sys\n"
    prompts = [shared + "def f(x):", shared + "class A:", shared + "x = ["]
    params = [SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=1),
              SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=0.8, seed=11, frequency_penalty=1.0,
                             logprobs=0),
              SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=3)]
    ref = _engine("none", "reference").generate(prompts, params)
    base = _engine("none", "cuda", depth=2, batch_invariant=True)
    spec = base.spec.model_dump(mode="python")
    spec["server"] |= {"block_size": 4, "max_num_batched_tokens": 6}
    eng = Engine(type(base.spec).model_validate(spec), base.target, base.tokenizer)
    for run in range(2):
        got = eng.generate(prompts, params)
        assert [c.output_ids for c in got] == [c.output_ids for c in ref]
        hits = [c.meta_info["cached_tokens"] > 0 for c in got]
        # the first run's third prompt waits for the blocks the second computes, then finds them
        assert hits == ([False, False, True] if run == 0 else [False, True, True])
        _same_logprobs(ref, got)


def test_penalised_drafting_with_accepted_drafts_equals_the_reference():
    """DFlash rounds whose drafts are mostly right (simulated acceptance over the reference's
    penalised continuation), two rounds in flight: every accepted draft is counted before the
    slots after it and before the next round, so greedy penalised output and its logprobs
    equal plain decoding's on the reference backend."""
    from draftline.core.simulated import SimulatedAcceptance

    params = SamplingParams(max_new_tokens=8, ignore_eos=True, frequency_penalty=1.0, presence_penalty=0.5,
                            repetition_penalty=1.2, logit_bias=((7, 2.0),), logprobs=1)
    ref = _engine("none", "reference").generate(PROMPTS[:1], params)[0]
    eng = _engine("dflash", "cuda", depth=2)
    eng.backend.set_draft_override(SimulatedAcceptance(
        0.9, {tuple(eng.encode(PROMPTS[0])): ref.output_ids}, 4, eng.backend.cache.max_len,
        eng.target.config.vocab_size, eng.device))
    got = eng.generate(PROMPTS[:1], params)[0]
    assert got.output_ids == ref.output_ids and got.meta_info["spec_accepted_tokens"] >= 3
    assert [e.logprob for e in got.logprobs] == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-4)
    assert [e.top for e in got.logprobs][0][0][0] == ref.logprobs[0].top[0][0]


def test_a_long_prompt_is_prefilled_apart_from_short_ones_and_emits_as_the_reference():
    """A prefill groups prompts by length (one long prompt does not pad the short ones to its
    width), and the tokens are the reference's."""
    from types import SimpleNamespace

    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    prompts = [PROMPTS[0], list(range(1, 301)), PROMPTS[2]]
    ref = _engine("none", "reference", max_model_len=512).generate(prompts, params)
    engine = _engine("none", "cuda", max_model_len=512)
    reqs = [SimpleNamespace(prompt_ids=[0] * n, params=SamplingParams(), prefilled=0) for n in (5, 300, 7)]
    assert engine.backend.prefiller._prefill_groups(reqs, [5, 300, 7]) == [[0, 2], [1]]
    got = engine.generate(prompts, params)
    assert [g.output_ids for g in got] == [r.output_ids for r in ref]


def test_a_prefill_group_splits_where_its_measured_prices_say_and_emits_as_the_reference(monkeypatch):
    """Prices that make a padded 4-row prefill dearer than a 2-row and a 1-row one: three
    prompts prefill as two forwards (prices.py), and tokens and accepted counts are the
    reference's. Without the invariant kernels a group is never split (its rows' results would
    follow start-up's timings)."""
    from types import SimpleNamespace

    from draftline.backends.cuda.prices import PrefillPrices

    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    ref = _engine("dflash", "reference").generate(PROMPTS[:3], params, trace=True)
    engine = _engine("dflash", "cuda", depth=2, batch_invariant=True)  # the split's rows compute alike
    engine.backend.prefiller.prices = PrefillPrices({(rows, width, False): ms for width in (16, 32, 64)
                                                     for rows, ms in ((1, 1.0), (2, 2.0), (4, 20.0))})
    reqs = [SimpleNamespace(prompt_ids=[0] * n, params=SamplingParams(), prefilled=0) for n in (5, 6, 7)]
    assert engine.backend.prefiller._prefill_groups(reqs, [5, 6, 7]) == [[0, 1], [2]]
    forwards, group = [], engine.backend.prefiller._prefill_group
    monkeypatch.setattr(engine.backend.prefiller, "_prefill_group", lambda rs, es: forwards.append(len(rs)) or group(rs, es))
    _same_rounds(ref, engine.generate(PROMPTS[:3], params, trace=True))
    assert forwards == [2, 1]
    plain = _engine("dflash", "cuda", depth=2, batch_invariant=False)  # the default is on where dtypes allow it
    plain.backend.prefiller.prices = engine.backend.prefiller.prices
    assert plain.backend.prefiller._prefill_groups(reqs, [5, 6, 7]) == [[0, 1, 2]]


@pytest.mark.parametrize("method,budget,temperature", [("none", 6, 0.0), ("dflash", 6, 0.0), ("eagle3", 6, 0.0),
                                                       ("gemma4_mtp", 6, 0.0), ("eagle3", 40, 0.0),
                                                       ("dflash", 6, 0.8)])
def test_a_prompt_prefilled_in_chunks_emits_and_drafts_as_prefilled_whole(method, budget, temperature, monkeypatch):
    """server.max_num_batched_tokens below a prompt's length: its prefill runs in chunks over
    several steps beside a running request (each chunk from its start, attending over the keys
    cached before it; the drafter takes later chunks as a round's extension: at budget 40 the
    EAGLE-3 head's queries go in windows), and tokens, drafts and accepted counts are those of
    the prompt prefilled whole (the prefix cache off, so every chunk is computed), greedy and
    seeded sampled."""
    long = "def f(x):\n    return [x + i for i in range(10)]\n" * (1 if budget < 16 else 4)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=temperature, seed=7)
    whole = _engine(method, "cuda", depth=2, batch_invariant=True,  # chunks need the invariant prefill
                    max_model_len=128 if budget < 16 else 256)
    assert whole.backend.chunked_prefill
    want = whole.generate([PROMPTS[0], long], params, trace=True)
    spec = whole.spec.model_dump(mode="python")
    spec["server"] |= {"max_num_batched_tokens": budget, "enable_prefix_caching": False}
    from draftline.backends.cuda import views
    windowed = []  # the long-window path of a later chunk's EAGLE-3 entries, spied on (on a GPU it runs
    spied = views._in_windows  # when start-up captures the later chunks' graphs, whatever the budget)
    monkeypatch.setattr(views, "_in_windows", lambda *a: windowed.append(1) or spied(*a))
    chunked = Engine(type(whole.spec).model_validate(spec), whole.target, whole.tokenizer)
    graphed = chunked.backend.prefiller.graphs.enabled
    short = chunked.add_request(PROMPTS[0], params, trace=True)
    while not short.output_ids:  # prefilled (in chunks too at budget 6): it runs its rounds from here
        chunked.step()
    probe = chunked.add_request(long, params, trace=True)
    chunked.step()
    assert 0 < probe.prefilled <= budget and not probe.output_ids  # one chunk, no token yet
    while chunked.scheduler.has_work():
        chunked.step()
    assert len(probe.prompt_ids) > 3 * budget
    assert bool(windowed) == (budget > 16) or (graphed and windowed)
    got = [chunked.completion(r) for r in (short, probe)]  # the requests' rounds do not depend on when they ran
    assert [c.output_ids for c in got] == [c.output_ids for c in want]
    assert [c.rounds for c in got] == [c.rounds for c in want]


@pytest.mark.parametrize("method,budget,temperature", [("none", 8192, 0.0), ("dflash", 8192, 0.0),
                                                       ("eagle3", 8192, 0.0), ("gemma4_mtp", 8192, 0.0),
                                                       ("eagle3", 5, 0.0), ("gemma4_mtp", 8192, 0.8)])
def test_prefix_cache_hits_emit_and_draft_as_without_the_cache(method, budget, temperature):
    """Prompts that share a prefix: the second pass copies the first pass's blocks in (the
    target's keys, the drafter's entries, the features a later chunk extends from) and
    prefills only the rest (at budget 5, in chunks after the hit); tokens, drafts and accepted
    counts are those of an engine without the cache (greedy and seeded sampled), and meta_info
    reports the cached tokens."""
    shared = "import os\nimport sys\n"
    prompts = [shared + "def f(x):", shared + "class A:"]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=temperature, seed=5)
    cold = _engine(method, "cuda", depth=2, batch_invariant=True)
    spec = cold.spec.model_dump(mode="python")
    spec["server"] |= {"enable_prefix_caching": False}
    want = Engine(type(cold.spec).model_validate(spec), cold.target, cold.tokenizer).generate(prompts, params, trace=True)
    spec["server"] |= {"enable_prefix_caching": True, "block_size": 4, "max_num_batched_tokens": budget}
    cached = Engine(type(cold.spec).model_validate(spec), cold.target, cold.tokenizer)
    assert cached.backend.prefix is not None
    first = cached.generate(prompts[:1], params, trace=True)
    again = cached.generate(prompts, params, trace=True)
    assert [c.rounds for c in first] == [c.rounds for c in want[:1]]  # the drafts too, not only what was kept
    assert [c.rounds for c in again] == [c.rounds for c in want]
    # the repeated prompt finds its own blocks (all but its last token's), the other the shared ones
    assert [r.meta_info["cached_tokens"] for r in again] == [(len(cached.encode(prompts[0])) - 1) // 4 * 4,
                                                            len(cached.encode(shared)) // 4 * 4]
    assert all(b.refs == 0 for b in cached.backend.prefix.blocks.values())  # released when the requests ended


@pytest.mark.parametrize("method, temperature", [("dflash", 0.0), ("eagle3", 0.0), ("gemma4_mtp", 0.0),
                                                  ("dflash", 0.8)])
def test_a_preempted_request_resumes_exactly(method, temperature):
    """Two rounds in flight: the machine collects them before it preempts, frees the slots,
    and the resumed prefill (prompt and generated tokens) goes on as if never stopped; a
    seeded sampled request draws what it drew unpreempted (draws keyed by seed and position)."""
    free = _engine(method, "cuda", depth=2, batch_invariant=True)
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=temperature, seed=3 + i) for i in range(2)]
    prompts = [PROMPTS[0], PROMPTS[2]]
    want = free.generate(prompts, params)
    data = free.spec.model_dump(mode="python")
    data["server"] |= {"block_size": 4}
    pool = kv_blocks(type(free.spec).model_validate(data), kv_lookahead(free.plan, free.machine.depth))
    admitted = [pool.blocks(len(free.encode(p)) + 1 + pool.lookahead) for p in prompts]
    data["server"] |= {"num_kv_blocks": sum(admitted)}  # both admitted, then too few blocks for both to go on
    assert sum(pool.most(len(free.encode(p)), 8) for p in prompts) > sum(admitted)
    tight = Engine(type(free.spec).model_validate(data), free.target, free.tokenizer)
    got = tight.generate(prompts, params)
    assert sum(c.meta_info["preemptions"] for c in got) > 0
    assert [c.output_ids for c in got] == [c.output_ids for c in want]
    backend = tight.backend
    assert len(backend.cache.slots.free) == backend.cache.scratch  # every slot back
    assert all(b.refs == 0 for b in backend.prefix.blocks.values())


@pytest.mark.parametrize("method, temperature", [("none", 0.0), ("dflash", 0.0), ("eagle3", 0.0),
                                                  ("gemma4_mtp", 0.0), ("eagle3", 0.8)])
def test_paged_kv_serves_what_static_slots_serve(method, temperature):
    """server.num_kv_blocks on the cuda backend: the target's keys live in a shared pool of
    4-token pages that rows take as they grow (their pages interleaved), two rounds in flight
    and the prefix cache on, and every output equals the static slots' (taken as the reference
    backend's, which the differential tests above hold them to for every method); the pool
    holds less than the slots would, and every page comes back; seeded sampling too."""
    free = _engine(method, "cuda", depth=2, batch_invariant=True)  # static slots, sized against
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=temperature, seed=n) for n in (9, 4, 7)]
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[1]]
    free.generate(prompts[:1], SamplingParams(max_new_tokens=1))  # a drafter's static cache is made at its first prompt
    want = _engine(method, "reference").generate(prompts, params)
    data = free.spec.model_dump(mode="python")
    data["server"] |= {"block_size": 4, "num_kv_blocks": 60}
    paged = Engine(type(free.spec).model_validate(data), free.target, free.tokenizer)
    cache = paged.backend.cache
    assert cache.pager is not None and cache.data.shape[2] == 61  # 60 pages and the scratch one
    assert cache.data.numel() < free.backend.cache.data.numel() // 2
    got = paged.generate(prompts, params)
    drafter = paged.backend.kv.cache  # DFlash's context and EAGLE-3's layer page with the target's table
    if method in ("dflash", "eagle3"):
        assert drafter.pager is cache.pager and drafter.data.shape[2] == 61
        assert drafter.data.numel() < free.backend.kv.cache.data.numel() // 2
    assert [c.output_ids for c in got] == [c.output_ids for c in want]
    _pages_free_or_cached(cache.pager, paged.backend.prefix)
    assert bool((cache.pages.table == cache.pager.scratch).all())  # every line back to the scratch page


def test_paged_kv_runs_four_times_the_requests_in_the_memory_of_static_slots():
    """Paging's measure on the tiny target: in the KV memory that two static slots of a
    128-token context take, eight requests of up to 47 tokens run at once, none preempted,
    each with the output the static slots give it (the reference backend's)."""
    static = _engine("none", "cuda", depth=2, slots=2, batch_invariant=True)  # sized only: never run
    per_page = 4 * static.backend.cache.data[:, :, 0, :, :1].numel()  # one 4-token page, every layer
    data = static.spec.model_dump(mode="python")
    data["server"] |= {"block_size": 4, "max_batch_size": 8, "enable_prefix_caching": False,
                       "num_kv_blocks": static.backend.cache.data.numel() // per_page - 1}
    paged = Engine(type(static.spec).model_validate(data), static.target, static.tokenizer)
    assert paged.backend.cache.data.numel() <= static.backend.cache.data.numel()
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = [p + str(i) for i in range(2) for p in PROMPTS]  # 8 prompts of 3 to 36 bytes
    reqs = [paged.add_request(p, params) for p in prompts]
    most = 0
    while paged.scheduler.has_work():
        paged.step()
        most = max(most, len(paged.scheduler.running))
    assert most == 8 and all(r.preemptions == 0 for r in reqs)
    # the static slots' outputs are the reference backend's (the differential tests above hold
    # them to it): it gives them at a fraction of 48 interpreted steps through two slots
    want = _engine("none", "reference").generate(prompts, params)
    assert [r.output_ids for r in reqs] == [c.output_ids for c in want]


def test_a_full_page_pool_takes_a_cancelled_requests_pages():
    """Paged KV with a pool three running requests fill and a fourth waiting: one is cancelled
    near its end; the others go on into new pages, the fourth is admitted into the freed ones,
    each ends with its full output, and every page comes back."""
    static = _engine("none", "cuda", depth=2, slots=3, batch_invariant=True)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    data = static.spec.model_dump(mode="python")
    data["server"] |= {"block_size": 4, "enable_prefix_caching": False}
    pool = kv_blocks(type(static.spec).model_validate(data), kv_lookahead(static.plan, static.machine.depth))
    data["server"]["num_kv_blocks"] = 3 * pool.most(len(static.encode(PROMPTS[1])), 12) - 2  # three barely fit
    paged = Engine(type(static.spec).model_validate(data), static.target, static.tokenizer)
    reqs = [paged.add_request(PROMPTS[1], params) for _ in range(4)]
    while len(reqs[0].output_ids) < 9:
        paged.step()
    assert len(paged.scheduler.running) == 3 and len(paged.scheduler.waiting) == 1  # the pool holds three
    reqs[0].cancelled = True  # while three nearly done fill the pool and the fourth waits
    while paged.scheduler.has_work():
        paged.step()
    want = _engine("none", "reference").generate([PROMPTS[1]], params)[0].output_ids  # the static slots' too
    assert reqs[0].finish_reason["type"] == "abort" and all(r.output_ids == want for r in reqs[1:])
    pager = paged.backend.cache.pager
    assert pager.in_use == 0 and len(pager.free) == data["server"]["num_kv_blocks"]


@pytest.mark.parametrize("method", ["dflash", "eagle3"])
def test_prompts_that_start_alike_hold_the_same_pages_for_what_they_share(method):
    """A cached prompt's blocks are mapped, not copied: two later prompts that start with its
    first blocks hold its pages at the front of their table lines while they run (an EAGLE-3
    head's last cached block excepted: it is copied into a page of the request's own, whose
    next chunk rewrites the entry there), and every output equals the reference backend's."""
    base = _engine(method, "cuda", depth=2, batch_invariant=True)
    data = base.spec.model_dump(mode="python")
    data["server"] |= {"block_size": 4, "num_kv_blocks": 60}
    engine = Engine(type(base.spec).model_validate(data), base.target, base.tokenizer)
    shared = PROMPTS[1] * 2  # several 4-token blocks
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    first = engine.generate([shared], params)[0]
    cached = [b.payload for b in engine.backend.prefix.blocks.values()]
    assert len(cached) >= 3
    reqs = [engine.add_request(shared + tail, params) for tail in ("x = 1", "y = 2")]
    engine.step()  # both prefilled: the hits mapped
    pager = engine.backend.cache.pager
    mapped = cached[:-1] if method == "eagle3" else cached
    for r in reqs:
        assert r.cached_tokens == 4 * len(cached)
        assert pager.owned[r.kv][: len(mapped)] == mapped  # the same physical pages
    assert all(pager.refs[p] == 1 + len(reqs) for p in mapped)  # the cache's hold and each line's
    while engine.scheduler.has_work():
        engine.step()
    want = _engine(method, "reference").generate([shared] + [shared + t for t in ("x = 1", "y = 2")], params)
    assert [first.output_ids] + [engine.completion(r).output_ids for r in reqs] == [c.output_ids for c in want]


def test_a_captured_prefill_shape_is_padded_over_whatever_the_shared_buffer_held():
    """Every prefill shape's views share one buffer, so start-up pads a shape just before its
    capture and timing: every row one token 0 in the scratch slot, greedy, ending nothing, and
    no block to save or feature to stage, whatever the buffer held."""
    plain = _engine("eagle3", "cuda", batch_invariant=True)
    spec = plain.spec.model_dump(mode="python")
    spec["server"] |= {"enable_prefix_caching": True, "block_size": 4}
    backend = Engine(type(plain.spec).model_validate(spec), plain.target, plain.tokenizer).backend.prefiller
    assert backend.prefix_store is not None and backend.ring is not None  # both tables in the view
    backend.pre.raw.fill_(12345)
    backend._pad_prefill(4, 16)
    v = backend.pre.view(4, 16)
    scratch = backend.cache.scratch
    assert v.cols.tolist() == [[1] * 4, [scratch] * 4, [scratch] * 4, [0] * 4, [0] * 4, [-1] * 4, [0] * 4]
    assert v.fcols.tolist() == [[0.0] * 4, [1.0] * 4, [0.0] * 4]
    assert v.counts.tolist() == [0, 0] and not v.ids.any()


def test_long_causal_windows_attend_in_pieces_as_whole():
    """A later chunk's drafter queries, too many query rows for one tile, attend in windows:
    each query sees the keys cached before the chunk and the chunk's up to its own position."""
    import torch.nn.functional as F

    from draftline.backends.cuda.attention import store_kv
    from draftline.backends.cuda.kv import StaticKV
    from draftline.backends.cuda.views import CAUSAL, KVView

    gen = torch.Generator().manual_seed(3)
    cache = StaticKV(1, 2, 2, 128, 16, torch.float32, torch.device(DEV))
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=gen))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=gen))
    start, w = [7, 30], 40  # 4 query heads over 2 kv heads: 80 query rows a kv head, past LONG_WINDOW
    q, k, v = (torch.randn(2, h, w, 16, generator=gen).to(DEV) for h in (4, 2, 2))
    slots, ends = torch.tensor([0, 1], device=DEV), torch.tensor(start, device=DEV) + w
    store_kv(k, v, cache.k[0], cache.v[0], slots, ends, cache.pages)  # as the q/k/v kernel stores them
    got = KVView(cache, slots, ends, CAUSAL).attend(q, 0)
    for i, s in enumerate(start):
        keys = cache.k[0][i, :, : s + w].repeat_interleave(2, dim=0)  # the chunk's keys stored by the call
        values = cache.v[0][i, :, : s + w].repeat_interleave(2, dim=0)
        mask = torch.arange(s + w, device=DEV)[None, :] <= s + torch.arange(w, device=DEV)[:, None]
        want = F.scaled_dot_product_attention(q[i], keys, values, attn_mask=mask)
        torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cache.k[0][i, :, s : s + w], k[i])


def test_a_request_cancelled_between_its_chunks_frees_its_slot_and_its_blocks():
    """A request cancelled part-way through a chunked prefill that met the prefix cache: its
    KV slot, its drafter slot and its pinned blocks are released, and the request beside it
    finishes as it would alone."""
    shared = "import os\nimport sys\n"
    base = _engine("eagle3", "cuda", depth=2, batch_invariant=True)
    spec = base.spec.model_dump(mode="python")
    spec["server"] |= {"block_size": 4, "max_num_batched_tokens": 5}
    engine = Engine(type(base.spec).model_validate(spec), base.target, base.tokenizer)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    alone = engine.generate(["x = ["], params)[0].output_ids
    engine.generate([shared + "def f(x):"], params)  # caches the shared blocks
    req = engine.add_request(shared + "class A:\n    pass\n", params)
    other = engine.add_request("x = [", params)
    engine.step()
    assert req.cached_tokens > 0 and req.prefilled < len(req.prompt_ids)  # a hit, then chunks
    req.cancelled = True
    while engine.scheduler.has_work():
        engine.step()
    assert req.finish_reason["type"] == "abort" and other.output_ids == alone
    backend = engine.backend
    assert len(backend.cache.slots.free) == backend.cache.scratch  # every KV slot back, the drafter's too
    assert len(backend.kv.slots.free) == backend.kv.num_slots
    assert all(b.refs == 0 for b in backend.prefix.blocks.values())


def test_the_hosts_inverse_temperature_is_the_devices_bit_for_bit():
    """A round's row load computes 1 / temperature on the host (numpy); the prefill and eager
    paths on the device (torch): the sampling kernels must scale logits alike either way."""
    from draftline.backends.cuda.buffers import host_inverse_temperature, inverse_temperature
    temps = torch.cat([torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 4,
                       torch.tensor([0.0, 1e-7, 1e-6, 0.1, 0.3333, 0.7, 1.0, 1.5, 2.0])]).float()
    host = torch.from_numpy(host_inverse_temperature(temps.numpy()))
    assert host.dtype == torch.float32
    assert torch.equal(host.view(torch.int32), inverse_temperature(temps).view(torch.int32))


def test_a_chunked_prompt_keeps_no_flight_past_the_pipeline_depth():
    """A long prompt prefilled in chunks (one new token) while new requests arrive every step,
    two rounds in flight: every launch is collected within two steps. By rows alone its last
    chunks' row never ran past depth, so the machine launched on behind them, the arrivals'
    prefills and rounds queued ahead of the streams' tokens (13 steps, 15 flights here; about
    100 ms at 32 streams on an H200), and the outputs equal the reference backend's."""
    def chunked(backend: str) -> Engine:
        spec = tiny_spec(METHODS["none"], max_batch_size=8, backend=backend, device=DEV, dtype="float32",
                         max_model_len=128)
        data = spec.model_dump(mode="python")
        data["server"].update(max_num_batched_tokens=8, pipeline_depth=2 if backend == "cuda" else 0)
        return Engine(type(spec).model_validate(data))

    params, one = SamplingParams(max_new_tokens=4, ignore_eos=True), SamplingParams(max_new_tokens=1, ignore_eos=True)
    long, later = "def f(x):\n    return x + 1\n" * 3, [f"y{k} = [" for k in range(12)]
    ref = chunked("reference")
    expected = [c.output_ids for c in ref.generate(PROMPTS[:2] + later, params)] + \
        [ref.generate([long], one)[0].output_ids]
    eng = chunked("cuda")
    reqs = [eng.add_request(p, params) for p in PROMPTS[:2]]
    eng.step()
    first = eng.add_request(long, one)
    oldest = []
    while eng.scheduler.has_work():
        if later:
            reqs.append(eng.add_request(later.pop(0), params))
        eng.step()
        oldest.append(eng.machine.steps - min((f.step for f in eng.machine.flights), default=eng.machine.steps))
    assert len(eng.encode(long)) > 3 * 8 and max(oldest) < eng.machine.depth == 2
    assert [eng.completion(r).output_ids for r in reqs + [first]] == expected


@pytest.mark.parametrize("method, pages", [("none", 7), ("dflash", 11)])  # a request takes up to 6 and 9
def test_random_joins_cancels_and_preemptions_leave_every_page_owned_once(method, pages):
    """A property test of the paged pool on the cuda backend, the prefix cache on: requests
    arrive (some sharing a prompt's first blocks, some in bursts that share two blocks no
    request has computed yet), are cancelled and are preempted at random
    through four slots and too few 4-token pages, two rounds in flight. After every step each
    page is free, or held by the slots' table lines (several, a shared prefix's page) and the
    prefix cache, as many times as its count says; a page some line holds is never free; only
    a running request's slot holds any; at the end every page is free or the cache's alone, and
    each request not cancelled emitted what the reference backend emits for its prompt."""
    import random

    from draftline.core.machine import Phase

    rng = random.Random(5)
    base = _engine(method, "cuda", depth=2, batch_invariant=True)
    data = base.spec.model_dump(mode="python")
    data["server"] |= {"block_size": 4, "num_kv_blocks": pages}
    engine = Engine(type(base.spec).model_validate(data), base.target, base.tokenizer)
    pager, reqs = engine.backend.cache.pager, []
    for step in range(16):
        if rng.random() < 0.7 and len(reqs) < 8:
            prompt = [rng.randrange(2, 200) for _ in range(rng.randrange(2, 6))]
            if reqs and rng.random() < 0.5:  # another's first block, then its own tokens: a prefix hit
                prompt = reqs[-1].prompt_ids[:4] + prompt
            params = SamplingParams(max_new_tokens=rng.randrange(6, 14), ignore_eos=True)
            reqs.append(engine.add_request(prompt, params))
            if rng.random() < 0.3:  # a burst: two blocks new to the cache, shared in flight
                shared = [rng.randrange(2, 200) for _ in range(8)]
                reqs += [engine.add_request(shared + [rng.randrange(2, 200)], params) for _ in range(2)]
        running = [r for r in engine.scheduler.running if r.phase is not Phase.FINISHED]
        if step % 5 == 4 and running:  # a client gone, its rounds in flight
            rng.choice(running).cancelled = True
        engine.step()
        _pages_owned_once(pager, {r.kv for r in engine.scheduler.running if r.phase is not Phase.FINISHED},
                          engine.backend.prefix)
    while engine.scheduler.has_work():
        engine.step()
        _pages_owned_once(pager, {r.kv for r in engine.scheduler.running if r.phase is not Phase.FINISHED},
                          engine.backend.prefix)
    _pages_free_or_cached(pager, engine.backend.prefix)
    assert sum(r.preemptions for r in reqs) > 0 and any(r.cancelled for r in reqs)
    assert any(r.cached_tokens >= 8 and r.prompt_ids[:8] == q.prompt_ids[:8] for r in reqs for q in reqs if q is not r)
    kept = [r for r in reqs if not r.cancelled]
    want = _engine(method, "reference").generate([r.prompt_ids for r in kept],
                                                 [r.params for r in kept])
    assert [r.output_ids for r in kept] == [c.output_ids for c in want]


def _pages_owned_once(pager, live_slots: set[int], prefix=None) -> None:
    """Every page free or held (host and device tables alike) by table lines and the prefix
    cache as many times as its count, lines only for live slots, none in a line twice."""
    pager.flush()
    holders = [0] * pager.num_pages
    for line in pager.owned:
        assert len(line) == len(set(line))
        for p in line:
            holders[p] += 1
    for block in ([] if prefix is None else prefix.blocks.values()):
        holders[block.payload] += 1
    assert holders == pager.refs
    assert sorted(p for p in range(pager.num_pages) if holders[p] == 0) == sorted(pager.free)  # none lost or held free
    table = pager.pages.table.cpu()
    for slot, line in enumerate(pager.owned):
        assert not line or slot in live_slots
        assert table[slot, : len(line)].tolist() == line
        assert bool((table[slot, len(line):] == pager.scratch).all())


def _pages_free_or_cached(pager, prefix) -> None:
    """No line holds a page: each is free, or the prefix cache's alone."""
    cached = [b.payload for b in prefix.blocks.values()]
    assert all(not line for line in pager.owned) and all(pager.refs[p] == 1 for p in cached)
    assert sorted(cached + pager.free) == list(range(pager.num_pages))
