"""The cuda backend held to the reference backend. On a GPU it runs with graphs (and the
`gpu`-marked checks add bf16 and graph-vs-eager comparisons); without one it runs eagerly on
the CPU through the Triton interpreter, so CI checks its buffers, static caches, windows and
kernels end to end."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
pytest.importorskip("triton")

from conftest import respec, tiny_spec  # noqa: E402
from core.engine import Engine  # noqa: E402
from core.sampling import SamplingParams  # noqa: E402
from core.spec import load_spec  # noqa: E402

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


def _engine(method: str, backend: str, **model) -> Engine:
    model = {"max_model_len": 128, **model}  # short caches: fewer attention splits to interpret on a CPU
    return Engine(tiny_spec(METHODS[method], max_batch_size=4, backend=backend, device=DEV, dtype="float32", **model))


@pytest.mark.parametrize("method", ["none", "dflash"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_tokens_equal_reference(method, batch):
    """float32: identical greedy tokens and identical accepted counts, mixed prompt lengths."""
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ref = _engine(method, "reference").generate(PROMPTS[:batch], params, trace=True)
    eng = _engine(method, "cuda")
    got = eng.generate(PROMPTS[:batch], params, trace=True)
    for r, g in zip(ref, got):
        assert g.output_ids == r.output_ids
        assert [x.accepted for x in g.rounds] == [x.accepted for x in r.rounds]
    assert eng.backend.rounds_ahead >= len(got[0].rounds) - 2  # all but the first round and the last were run ahead


@pytest.mark.parametrize("method_name", ["eagle3", "gemma4_mtp"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("draft", ["greedy", "probabilistic"])
def test_chain_methods_equal_reference(method_name, batch, draft):
    """EAGLE-3 (its head entries written by position: the window's in the verify step, the last
    verified one in the draft step) and the frozen-KV MTP drafter (reading the target's static
    cache and the backend's last verified features): identical tokens and accepted counts,
    greedy (the graph-captured path, run ahead) and with sampled drafts (eager, seeded)."""
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.0 if draft == "greedy" else 1.0,
                             seed=7 + i) for i in range(batch)]
    method = {**METHODS[method_name], "draft_sample_method": draft}
    specs = [tiny_spec(method, max_batch_size=4, backend=b, device=DEV, dtype="float32", max_model_len=128)
             for b in ("reference", "cuda")]
    ref = Engine(specs[0]).generate(PROMPTS[:batch], params, trace=True)
    eng = Engine(specs[1])
    got = eng.generate(PROMPTS[:batch], params, trace=True)
    for r, g in zip(ref, got):
        assert g.output_ids == r.output_ids
        assert [x.accepted for x in g.rounds] == [x.accepted for x in r.rounds]
    if draft == "greedy":
        assert eng.backend.rounds_ahead >= len(got[0].rounds) - 2


@pytest.mark.parametrize("method", ["none", "dflash", "eagle3", "gemma4_mtp"])
def test_run_ahead_rounds_are_dropped_when_rows_change(method):
    """Requests ending at different rounds (length limits, EOS) and a queue admitting new ones:
    a round launched ahead for rows that then change is ignored, and tokens still equal the
    reference's."""
    params = [SamplingParams(max_new_tokens=n, ignore_eos=n != 7) for n in (3, 9, 5, 7, 2, 6)]
    ref = _engine(method, "reference").generate(PROMPTS + PROMPTS[:2], params)
    eng = _engine(method, "cuda")
    got = eng.generate(PROMPTS + PROMPTS[:2], params)  # six requests through four slots
    assert [g.output_ids for g in got] == [r.output_ids for r in ref]
    assert eng.backend.rounds_ahead > 0


def test_trained_pair_accepts_the_same_drafts():
    """With the shipped trained pair (drafts are often accepted) both backends take the same
    rounds: the drafter's static context, its graph-safe update and the block attention agree."""
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    shipped = load_spec("specs/tiny-dflash.yaml")
    specs = [respec(shipped, backend, max_batch_size=1, device=DEV, dtype="float32", max_model_len=128)
             for backend in ("reference", "cuda")]
    ref, got = (Engine(s, draft_policy="always").generate(PROMPTS[1:2], params, trace=True) for s in specs)
    for r, g in zip(ref, got):
        assert g.output_ids == r.output_ids
        assert [x.accepted for x in g.rounds] == [x.accepted for x in r.rounds]
        assert sum(x.accepted for x in r.rounds) > 5  # drafts were accepted: the check has teeth


def test_seeded_sampling_repeats_and_batches_alike():
    """Sampling keyed by (seed, position): a request gives the same tokens alone, in a batch
    and run again."""
    params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=8, ignore_eos=True) for s in (3, 4)]
    eng = _engine("dflash", "cuda")
    batch = eng.generate(PROMPTS[:2], params)
    alone = [eng.generate([p], s)[0] for p, s in zip(PROMPTS[:2], params)]
    assert [c.output_ids for c in batch] == [c.output_ids for c in alone]
    assert eng.generate(PROMPTS[:1], params[:1])[0].output_ids == batch[0].output_ids
    assert batch[0].output_ids != batch[1].output_ids  # seeds matter


def test_slots_are_reused_after_requests_finish():
    eng = _engine("dflash", "cuda")
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    first = eng.generate(PROMPTS * 2, params)  # 8 requests through 4 slots
    assert len(first) == 8 and all(len(c.output_ids) == 4 for c in first)
    assert sorted(eng.backend.cache.slots.free) == [0, 1, 2, 3]
    assert eng.generate(PROMPTS[:1], params)[0].output_ids == first[0].output_ids


def test_probabilistic_drafting_runs_eagerly_and_stays_lossless():
    """Drafts sampled from the drafter's q take the eager draft path and the rejection kernel;
    greedy requests still get the reference's tokens, sampled ones repeat under their seed."""
    spec = {**METHODS["dflash"], "draft_sample_method": "probabilistic"}
    engines = [Engine(tiny_spec(spec, max_batch_size=2, backend=backend, device=DEV, dtype="float32", max_model_len=128))
               for backend in ("reference", "cuda")]
    greedy = SamplingParams(max_new_tokens=8, ignore_eos=True)
    ref, got = (e.generate(PROMPTS[:2], greedy) for e in engines)
    assert [c.output_ids for c in got] == [c.output_ids for c in ref]
    sampled = [SamplingParams(temperature=1.0, seed=9, max_new_tokens=8, ignore_eos=True)] * 2
    first = [c.output_ids for c in engines[1].generate(PROMPTS[:2], sampled)]
    assert [c.output_ids for c in engines[1].generate(PROMPTS[:2], sampled)] == first


@pytest.mark.parametrize("method", ["none", "eagle3"])
def test_graph_steps_are_idempotent(method):
    """Graph capture runs a step twice for real before recording it, so a step must give the
    same outputs and leave the same state when run again on the same buffers: the verify step
    leaves the rows' next last token and start in `next`, never moving the rows it read."""
    eng = _engine(method, "cuda")
    req = eng.add_request(PROMPTS[1], SamplingParams(max_new_tokens=8, ignore_eos=True))
    eng.step()  # prefill, and one round
    backend, width = eng.backend, eng.backend.width
    backend.bufs.load([req], 1)
    if width > 1:
        backend._draft_step(1)
    runs = []
    for _ in range(2):
        _, _, packed = backend._verify_step(1, width, True)
        runs.append((packed.clone(), backend.bufs.meta.clone(), backend.bufs.next.clone()))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert int(runs[0][2][1, 0]) == req.seq_len + int(runs[0][0][0, 1])  # next start: past the accepted drafts


def test_settle_flags_rows_with_non_finite_logits():
    """The verify graph decides on the device: a row with any non-finite logit (counted by the
    draw kernel, chunk by chunk) is flagged for the host, the others are decided as usual and
    step on past their emitted token."""
    eng = _engine("none", "cuda")
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=8, ignore_eos=True)) for p in PROMPTS[:3]]
    eng.step()
    backend = eng.backend
    backend.bufs.load(reqs, 4)
    vocab = backend.target.lm_head.weight.shape[0]
    logits = torch.randn(4, 1, vocab, generator=torch.Generator().manual_seed(0)).to(DEV)
    logits[1, 0, vocab - 2] = float("nan")  # in the last chunk
    logits[2, 0, 0] = float("-inf")
    packed = backend._settle(4, 1, logits, False).cpu()
    assert packed[:3, 0].tolist() == [1, 0, 0]
    assert packed[0, 1] == 0 and packed[0, 2] == logits[0, 0].argmax().item()  # greedy, no drafts
    nxt = backend.bufs.next[:, :3].cpu()
    assert nxt[0, 0] == packed[0, 2] and nxt[1, 0] == reqs[0].seq_len


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_settle_accepts_from_the_heads_draws_as_from_the_logits(temperature):
    """A head that folded its draws (matvec_draw) leaves raw draws and non-finite counts in the
    scratch; the settle takes them and accepts drafts while they match. The packed result and
    each row's next token and start are those of the draw kernels' path."""
    from backends.cuda import sampling as kernels
    from backends.cuda.buffers import INV_TEMP, SEED, START
    from backends.cuda.matvec import EMPTY

    eng = _engine("none", "cuda")
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=temperature, seed=i))
            for i, p in enumerate(PROMPTS[:3])]
    eng.step()
    backend, b = eng.backend, eng.backend.bufs
    width = b.drafts.shape[1] + 1
    b.load(reqs, 4)
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
    outcomes = []
    for drawn in (False, True):
        if drawn:  # as the head's matvec_draw leaves them
            b.argmax.best[: 4 * width] = (1 << 32) - 1 - draws.view(-1)  # a winner's value bits are not read
            b.argmax.bad[: 4 * width] = counts.int()
        packed = backend._settle(4, width, logits, drawn).cpu()
        outcomes.append((packed, b.next[:, :4].cpu().clone()))
    assert bool((b.argmax.best == EMPTY).all()) and not bool(b.argmax.bad.any())  # taken
    assert torch.equal(*[o[0] for o in outcomes]) and torch.equal(*[o[1] for o in outcomes])
    assert outcomes[0][0][:3, :2].tolist() == [[1, width - 2], [1, width - 1], [0, 0]]


def test_branch_work_is_done_at_the_join_eagerly_and_in_a_graph():
    """overlap.Branch: what runs under fork() is done once the step's stream passes join(), in
    a captured graph too; a join with nothing forked leaves a capture intact (a verify step
    without a drafter joins, and waiting on the side stream's earlier uncaptured work would
    break the capture)."""
    from backends.cuda.overlap import Branch

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
