"""The CUDA backend's Triton kernels against core/sampling.py. Without a GPU they run in the
Triton interpreter (TRITON_INTERPRET=1), so CI exercises every kernel on the CPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
pytest.importorskip("triton")

from draftline.backends.cuda import sampling as kernels  # noqa: E402
from draftline.core.sampling import SamplingBatch, SamplingParams, Stream, accept_drafts, probs_from_logits, sample  # noqa: E402
from stats import chi_square_p  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log")  # log(0) = -inf, by design


def _logp(probs):
    return torch.log(probs).to(DEV)


@pytest.mark.parametrize("chunk", [4096, 256])  # 256: five vocabulary chunks, the last one ragged
def test_sampling_kernel_matches_the_oracle_draw_for_draw(chunk):
    torch.manual_seed(0)
    n, v = 32, 1100  # v not a multiple of the block: the tail is masked
    probs = probs_from_logits(torch.randn(n, v) * 2, SamplingBatch.of([SamplingParams(temperature=1.0, top_k=200)] * n))
    seed, pos = torch.arange(n) * 7919 + 2**40, torch.arange(n) + 100
    want = sample(probs, seed, pos, Stream.SAMPLE)
    got = kernels.sample(_logp(probs), seed.to(DEV), pos.to(DEV), block=128, chunk=chunk).cpu()
    assert (got == want).float().mean() >= 0.99  # float32 log may differ by an ulp at a near-tie
    assert torch.equal(got, kernels.sample(_logp(probs), seed.to(DEV), pos.to(DEV), block=128, chunk=chunk).cpu())


@pytest.mark.parametrize("chunk", [4096, 256])
def test_a_drafters_draw_from_q_matches_the_reference_draw(chunk):
    """CudaOps.draw (probabilities in, one pass): core.sampling.sample's draws, one-hot rows
    (greedy rows of a sampled batch) exactly, zeros (filtered columns) never drawn."""
    torch.manual_seed(1)
    n, v = 24, 1100
    params = [SamplingParams(temperature=1.0, top_p=0.8)] * (n - 4) + [SamplingParams(temperature=0.0)] * 4
    q = probs_from_logits(torch.randn(n, v) * 2, SamplingBatch.of(params))
    seed, pos = torch.arange(n) * 104729 + 2**33, torch.arange(n) * 3 + 7
    want = sample(q, seed, pos, Stream.DRAFT)
    got = kernels.draw(q.to(DEV), seed.to(DEV), pos.to(DEV), Stream.DRAFT, block=128, chunk=chunk).cpu()
    assert (got == want).float().mean() >= 0.95  # float32 log may differ by an ulp at a near-tie
    assert torch.equal(got[-4:], q[-4:].argmax(-1)) and bool((q[torch.arange(n), got] > 0).all())


def test_greedy_draw_breaks_ties_to_the_lower_index_across_chunks():
    n, v = 6, 300
    logits = torch.zeros(n, v)
    tied = [(3, 250), (70, 71), (64, 128), (0, 299), (200, 100), (129, 5)]
    for r, (a, b) in enumerate(tied):
        logits[r, [a, b]] = 5.0
    zeros = torch.zeros(n, dtype=torch.long).to(DEV)
    got = kernels.sample(logits.to(DEV), zeros, zeros, inv_temp=torch.zeros(n).to(DEV), chunk=64).cpu()
    assert got.tolist() == [min(a, b) for a, b in tied]


def test_sampling_kernel_greedy_is_exact_and_distribution_is_right():
    n, v = 64, 300  # the interpreter runs a program per row: 64 hot indices spread over all three blocks
    hot = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(1))
    onehot = torch.nn.functional.one_hot(hot, v).float()
    zeros = torch.zeros(n, dtype=torch.long)
    assert torch.equal(kernels.sample(_logp(onehot), torch.arange(n).to(DEV), zeros.to(DEV), block=128).cpu(), hot)
    p = torch.tensor([0.5, 0.25, 0.15, 0.1])
    m = 600  # 4 cells, each expected 60+ times; a correct kernel fails the 1e-3 threshold 0.1% of the time
    draws = kernels.sample(_logp(p.expand(m, -1).contiguous()), torch.arange(m).to(DEV), torch.full((m,), 3).to(DEV), block=4)
    assert chi_square_p(torch.bincount(draws.cpu(), minlength=4), p) > 1e-3


@pytest.mark.parametrize("temperature,chunk", [(0.0, 4096), (0.9, 4096), (0.0, 64), (0.9, 64)])
def test_acceptance_kernel_matches_the_oracle(temperature, chunk):
    torch.manual_seed(2)
    n, k, v = 8, 5, 300  # 8 rows: cuts at several depths, and the interpreter runs a program per row and chunk
    logits = torch.randn(n, k + 1, v) * 3
    batch = SamplingBatch.of([SamplingParams(temperature=temperature, seed=s) for s in range(n)])
    probs = probs_from_logits(logits, batch)
    target = sample(probs.reshape(-1, v), batch.seed.repeat_interleave(k + 1),
                    (torch.arange(n)[:, None] * 0 + 50 + torch.arange(k + 1)).reshape(-1), Stream.SAMPLE).view(n, k + 1)
    drafts = target[:, :k].clone()
    cut = torch.randint(0, k + 1, (n,))  # row r matches the target's own draws up to cut[r]
    for r in range(n):
        if cut[r] < k:
            drafts[r, cut[r]] = (drafts[r, cut[r]] + 1) % v
    first = torch.full((n,), 50)
    want = accept_drafts(probs, drafts, None, batch.seed, first, batch.temperature == 0)
    num, tokens = kernels.accept_matching(_logp(probs), drafts.to(DEV), batch.seed.to(DEV), first.to(DEV), block=32,
                                          chunk=chunk)
    num, tokens = num.cpu(), tokens.cpu()
    assert all((tokens[r, num[r] + 1:] == -1).all() for r in range(n))  # nothing past the emitted token
    shifted = kernels.accept_matching(_logp(probs), drafts.to(DEV), batch.seed.to(DEV), (first - 1).to(DEV),
                                      block=32, chunk=chunk, shift=1)  # keyed by first + shift: the same draws
    assert torch.equal(shifted[0].cpu(), num) and torch.equal(shifted[1].cpu(), tokens)
    agree = [int(num[r]) == int(want.num_accepted[r]) == int(cut[r])
             and torch.equal(tokens[r, : num[r] + 1], want.tokens[r, : num[r] + 1]) for r in range(n)]
    # greedy: every row exact; sampled: a float32 log may differ by an ulp at a near-tie
    assert sum(agree) >= (n if temperature == 0 else n - 1)


def test_draw_counts_non_finite_scores_per_chunk():
    """accept_matching's ``bad``: each real vocabulary chunk's count of NaN and infinite scores."""
    n, k, v, chunk = 3, 2, 300, 64
    logits = torch.randn(n, k + 1, v, generator=torch.Generator().manual_seed(4))
    logits[0, 1, 5] = float("nan")
    logits[0, 1, 70] = float("inf")
    logits[2, 2, v - 1] = float("-inf")
    _, real, padded = kernels.chunking(v, chunk)
    bad = torch.full((n * (k + 1), padded), -1, dtype=torch.int32).to(DEV)
    zeros = torch.zeros(n, dtype=torch.long).to(DEV)
    kernels.accept_matching(logits.to(DEV), torch.zeros(n, k, dtype=torch.long).to(DEV), zeros, zeros,
                            inv_temp=torch.zeros(n).to(DEV), chunk=chunk, bad=bad)
    want = (~torch.isfinite(logits)).reshape(n * (k + 1), v)
    want = torch.nn.functional.pad(want, (0, real * chunk - v)).view(n * (k + 1), real, chunk).sum(-1)
    assert torch.equal(bad[:, :real].cpu(), want.int())
    assert (bad[:, real:] == 0).all()  # chunks past the vocabulary are written too: no fill needed


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rejection_kernel_matches_the_oracle(temperature):
    """Drafts sampled from a drafter's own q: accept/reject, residual and bonus as the oracle."""
    torch.manual_seed(3)
    n, k, v = 16, 4, 200
    batch = SamplingBatch.of([SamplingParams(temperature=temperature, seed=100 + s) for s in range(n)])
    p = probs_from_logits(torch.randn(n, k + 1, v) * 2, batch)
    q = probs_from_logits(torch.randn(n, k, v) * 2 + torch.log(p[:, :k] + 1e-3), batch)  # correlated with p
    first = torch.arange(n) + 30
    drafts = torch.stack([sample(q[:, i], batch.seed, first + i, Stream.DRAFT) for i in range(k)], dim=1)
    want = accept_drafts(p, drafts, q, batch.seed, first)
    num, tokens = kernels.accept_rejection(p.to(DEV), q.to(DEV), drafts.to(DEV), batch.seed.to(DEV), first.to(DEV),
                                           block=64)
    num, tokens = num.cpu(), tokens.cpu()
    agree = [int(num[r]) == int(want.num_accepted[r]) and torch.equal(tokens[r, : num[r] + 1], want.tokens[r, : num[r] + 1])
             for r in range(n)]
    assert sum(agree) >= (n if temperature == 0 else n - 1)
    assert 0 < int(want.num_accepted.sum()) < n * k  # accepts and rejections both happened


def test_window_kernels_match_their_pytorch_forms():
    """The DFlash block and the verify window built in one launch each, against plain PyTorch:
    rows of different lengths, a width that is not a power of two."""
    from draftline.core.models.eager import EAGER
    from draftline.backends.cuda.windows import block_window, verify_window

    last, start = torch.tensor([5, 17, 2], device=DEV), torch.tensor([0, 40, 9], device=DEV)
    for width in (16, 5):
        got, want = block_window(last, start, 99, width), EAGER.block_window(last, start, 99, width)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    meta = torch.stack([last, start, torch.zeros_like(last)])  # rows: last token, start, (unused)
    drafts = torch.arange(12, device=DEV).view(3, 4) + 100  # [N, K]
    ids, positions, ends = verify_window(meta, drafts, 3, 4, 0, 1)  # W = 4 < K + 1: the last draft is not read
    assert torch.equal(ids, torch.cat([last[:, None], drafts[:, :3]], dim=1))
    assert torch.equal(positions, start[:, None] + torch.arange(4, device=DEV))
    assert torch.equal(ends, start + 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_feature_ring_kernels_equal_indexing(dtype):
    """FeatureRing's write and read kernels against the indexing they replace: positions that
    wrap the ring, a padding row at -1 (floor mod: the ring's last row), strided features of
    another dtype, and more features than one program step (F past the block)."""
    from draftline.backends.cuda.buffers import FeatureRing

    torch.manual_seed(0)
    ring = FeatureRing(num_slots=5, depth=7, width=1100, dtype=dtype, device=torch.device(DEV))
    ring.BLOCK = 256  # several loop steps over the 1,100 features
    want = ring.data.clone()
    slots, start = torch.tensor([4, 0, 2, 5], device=DEV), torch.tensor([12, 0, 5, -1], device=DEV)
    wide = torch.randn(4, 3, 2 * 1100, device=DEV)  # float32, strided: every other column
    features = wide[:, :, ::2]
    ring.write(slots, start, features)
    rows = (start[:, None] + torch.arange(3, device=DEV)) % 7
    want[slots[:, None], rows] = features.to(dtype)
    assert torch.equal(ring.data, want)
    for shift in (-1, 0, 2):
        assert torch.equal(ring.read(slots, start, shift=shift), want[slots, (start + shift) % 7])
    with pytest.raises(ValueError, match="holds 1100 features"):
        ring.write(slots, start, features[..., :10])
