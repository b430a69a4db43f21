"""The decode matvec kernels against x @ W.T, and the consumers of their partial sums. Without
a GPU they run in the Triton interpreter (TRITON_INTERPRET=1)."""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
pytest.importorskip("triton")

from draftline.backends.cuda.embedding import embed_beside  # noqa: E402
from draftline.backends.cuda import linear as fused  # noqa: E402
from draftline.backends.cuda.head import head_argmax, head_draw, lm_logits, row_argmax  # noqa: E402
from draftline.backends.cuda.linear import linear  # noqa: E402
from draftline.backends.cuda.norm import add_norm, norm  # noqa: E402
from draftline.backends.cuda.matvec import (EMPTY, ArgmaxScratch, Draw, Tiling, choose_tiling, device_tiling,  # noqa: E402
                                  matvec, matvec_argmax, matvec_draw)
from draftline.backends.cuda.sampling import sample  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEV == "cpu", reason="the Triton interpreter misreads bf16 tensors; the GPU runs these"))


def _ref(x, w, gated):
    y = x.double() @ w.double().T
    if gated:
        gate, up = y.chunk(2, dim=1)
        y = F.silu(gate) * up
    return y


@pytest.mark.parametrize("m", [1, 3, 16, 40])
@pytest.mark.parametrize("split,gated", [(1, False), (2, False), (4, False), (1, True)])  # gated: whole sums
def test_matvec_matches_the_product(m, split, gated):
    torch.manual_seed(m * 10 + split)
    n, k = 72, 256  # 72 outputs: the last column block is ragged
    x = torch.randn(m, k, device=DEV)
    w = torch.randn(2 * n if gated else n, k, device=DEV)
    out = matvec(x, w, Tiling(32, 32, split, 4, 2), gated)
    if split > 1:
        assert out.shape == (split, m, n) and out.dtype == torch.float32
        out = out.sum(0)
    assert out.shape == (m, n)
    torch.testing.assert_close(out.double().cpu(), _ref(x, w, gated).cpu(), rtol=1e-4, atol=1e-3)  # fp32 sum order


def test_matvec_rejects_shapes_it_cannot_tile():
    x, w = torch.randn(2, 96, device=DEV), torch.randn(8, 96, device=DEV)
    with pytest.raises(ValueError, match="does not divide"):
        matvec(x, w, Tiling(32, 64, 1, 4, 2))
    with pytest.raises(ValueError, match="columns"):
        matvec(x, torch.randn(8, 64, device=DEV), Tiling(32, 32, 1, 4, 2))


def test_tiling_splits_small_matrices_and_leaves_wide_batches_to_the_library():
    assert device_tiling(65, 4096, 4096) is None  # arithmetic-bound: cuBLAS
    assert device_tiling(1, 4096, 100) is None  # K not a multiple of a power-of-two step
    o = device_tiling(1, 4096, 4096)
    assert o.split == 4 and o.block_k == 128  # 64 column blocks x 4 K chunks
    assert device_tiling(1, 151936, 4096).split == 1  # plenty of column blocks already
    assert device_tiling(16, 12288, 4096, gated=True).split == 1
    chosen = choose_tiling(1, 4096, 4096)  # the interpreter's: the same split, wider tiles
    assert chosen == o if DEV == "cuda" else (chosen.split, chosen.block_n, chosen.block_k) == (4, 512, 512)
    assert choose_tiling(65, 4096, 4096) is None


@pytest.mark.parametrize("m", [1, 12, 64, 80])
def test_linear_partials_feed_add_norm(m):
    """What the fused stack does between layers: the down projection's (possibly partial) sums
    are added to the residual inside the norm kernel, rounded as an eager add would be."""
    torch.manual_seed(m)
    h = torch.randn(m, 256, device=DEV)
    x = torch.randn(m, 512, device=DEV)
    w = torch.randn(256, 512, device=DEV) / 16
    norm_w = torch.rand(256, device=DEV) + 0.5
    a = linear(x, w)
    total, normed = add_norm(a, h, norm_w, 1e-6)
    want = h + x @ w.T
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-4)
    ref = want * torch.rsqrt(want.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w
    torch.testing.assert_close(normed, ref, rtol=1e-5, atol=1e-4)


def test_a_small_weight_past_the_matvec_rows_is_one_launch_whatever_the_rows(monkeypatch):
    """A launch-bound weight past the decode matvec's 64 rows (a tiny drafter's 16-token blocks
    at 16 rows): the invariant matvec, the gated form's SiLU·up inside it (no second launch), and
    a row's values the same bits whatever the rows beside it; a large weight keeps the library."""
    import draftline.backends.cuda.linear as fused

    def library(*args, **kwargs):
        raise AssertionError("a launch-bound product went to the matrix library")

    torch.manual_seed(0)
    x = torch.randn(130, 128, device=DEV)
    w = torch.randn(2 * 96, 128, device=DEV) / 8
    monkeypatch.setattr(fused.F, "linear", library)
    monkeypatch.setattr(fused, "silu_mul", library)
    y = linear(x, w, gated=True)
    torch.testing.assert_close(y.double(), _ref(x, w, True), rtol=1e-4, atol=1e-4)
    assert torch.equal(linear(x[:70], w, gated=True), y[:70])
    monkeypatch.undo()
    assert fused.launch_bound(65, w) and not fused.launch_bound(64, w)
    assert not fused.launch_bound(65, torch.empty(4096, 4096, device="meta"))


@pytest.mark.parametrize("m", [1, 16])
def test_norm_adds_partial_sums(m):
    """A projection's partial sums normalized with no residual (a DFlash context's fc + norm)."""
    torch.manual_seed(m)
    x = torch.randn(m, 1024, device=DEV)
    w = torch.randn(256, 1024, device=DEV) / 32
    norm_w = torch.rand(256, device=DEV) + 0.5
    a = linear(x, w)
    assert a.dim() == 3  # 256 outputs: split, partial sums
    y = x @ w.T
    want = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w
    torch.testing.assert_close(norm(a, norm_w, 1e-6, m), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_linear_norm_keeps_the_projection_it_normalizes(m, dtype):
    """A chain step's entry (an MTP pre-projection and the first layer's norm): the projection
    rounded to the model dtype, as the library's would be, and its norm, from one norm launch."""
    torch.manual_seed(m)
    x = torch.randn(m, 512, device=DEV).to(dtype)
    w = (torch.randn(256, 512, device=DEV) / 16).to(dtype)
    norm_w = (torch.rand(256, device=DEV) + 0.5).to(dtype)
    h = torch.empty(m, 256, dtype=dtype, device=DEV)  # CudaOps.add_norm with no residual: the projection kept
    normed = norm(linear(x, w), norm_w, 1e-6, m, keep=h)
    want = (x.double() @ w.double().T).to(dtype)
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    assert h.dtype == normed.dtype == dtype and h.shape == normed.shape == (m, 256)
    torch.testing.assert_close(h, want, **tol)
    ref = want.float() * torch.rsqrt(want.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(normed, (ref.to(dtype) * norm_w), **tol)
    torch.testing.assert_close(normed, norm(h, norm_w, 1e-6, m))  # what a norm of the kept h gives


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_embed_beside_is_the_scaled_rows_then_the_other(dtype):
    """An MTP step's input in one launch: exactly torch.cat([table[ids] * s, other]), the
    multiply in float32 and rounded, as PyTorch's GPU kernels multiply a tensor by a number
    (its CPU kernels round the number to bf16 first)."""
    torch.manual_seed(0)
    table = torch.randn(100, 48, device=DEV).to(dtype)
    ids = torch.tensor([[3], [99], [0], [3]], device=DEV)
    other = torch.randn(4, 1, 40, device=DEV).to(dtype)
    got = embed_beside(table, ids, 16.0 ** 0.5 * 1.1, other)
    assert torch.equal(got, torch.cat([(table[ids].float() * (16.0 ** 0.5 * 1.1)).to(dtype), other], dim=-1))
    with pytest.raises(ValueError, match="does not follow ids"):
        embed_beside(table, ids, 2.0, other[:3])


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("rows", [1, 5])
def test_normed_beside_is_the_two_norms_side_by_side(dtype, rows):
    """An EAGLE-3 step's input in one launch: the embedding rows and the hidden state through
    their own RMSNorms, side by side, the same bits as two norm launches (and the eager norms)."""
    from draftline.backends.cuda.embedding import normed_beside
    from draftline.core.models.layers import RMSNorm

    torch.manual_seed(rows)
    table = torch.randn(100, 48, device=DEV).to(dtype)
    ids = torch.randint(0, 100, (rows, 1), device=DEV)
    other = torch.randn(rows, 1, 48, device=DEV).to(dtype)
    norm_a, norm_b = RMSNorm(48, 1e-6).to(DEV, dtype), RMSNorm(48, 1e-6).to(DEV, dtype)
    with torch.no_grad():
        norm_a.weight.uniform_(0.5, 1.5)
        norm_b.weight.uniform_(0.5, 1.5)
        got = normed_beside(table, ids, norm_a, other, norm_b)
        two = [norm(x.reshape(rows, 48), n.weight, n.eps, rows) for x, n in ((table[ids], norm_a), (other, norm_b))]
        assert torch.equal(got.reshape(rows, 96), torch.cat(two, dim=-1))
        torch.testing.assert_close(got, torch.cat([norm_a(table[ids]), norm_b(other)], dim=-1))
    with pytest.raises(ValueError, match="does not follow ids"):
        normed_beside(table, ids, norm_a, other[..., :40], norm_b)


@pytest.mark.parametrize("m", [1, 15])
def test_head_argmax_is_the_first_largest_rounded_logit(m):
    """The greedy readout that never writes logits: torch's argmax over the head's output in
    the model dtype, ties (common once rounded to bf16) going to the first column, across
    column blocks and a ragged last block."""
    torch.manual_seed(m)
    head = torch.nn.Linear(128, 1000, bias=False).to(DEV)
    head.weight.data[700] = head.weight.data[300]  # equal logits in two column blocks
    head.weight.data[301] = head.weight.data[300]  # and within one
    hidden = torch.randn(m, 128, device=DEV)
    hidden[0] = head.weight.data[300] * 4  # row 0's largest logit sits at 300, 301 and 700
    got = head_argmax(head, hidden[None])
    assert got.shape == (1, m) and got.dtype == torch.int64
    assert torch.equal(got[0], head(hidden).argmax(-1)) and got[0, 0] == 300
    if DEV == "cuda":  # bf16 rounding is checked on the GPU: the interpreter's bf16 products are not its
        bf = head.to(torch.bfloat16)
        assert torch.equal(head_argmax(bf, hidden.to(torch.bfloat16)), bf(hidden.to(torch.bfloat16)).argmax(-1))
    assert choose_tiling(m, 1000, 128).split == 1


@pytest.mark.parametrize("n", [1000, 9000])  # one block, and three with a ragged last
def test_row_argmax_is_torchs_argmax(n):
    """The argmax launch past one row tile (a DFlash block's drafts): the first largest, ties
    within and across blocks, a NaN as largest, rows of -inf, and a head past MAX_ROWS rows."""
    torch.manual_seed(n)
    x = torch.randn(70, n, device=DEV).round(decimals=1)  # many ties
    x[1, 5], x[1, n - 1] = 9.0, 9.0
    x[2, n - 1] = float("nan")
    x[3, 7], x[3, 3] = float("nan"), float("nan")
    x[4] = float("-inf")
    x[5, :] = 0.0
    x[6, n - 1] = float("inf")
    assert torch.equal(row_argmax(x), x.argmax(-1))
    assert torch.equal(row_argmax(x[:, 2:]), x[:, 2:].argmax(-1))  # a strided view
    head = torch.nn.Linear(64, 500, bias=False).to(DEV)
    hidden = torch.randn(5, 20, 64, device=DEV)  # 100 rows: past MAX_ROWS
    assert torch.equal(head_argmax(head, hidden), head(hidden).argmax(-1))


def test_argmax_counts_nan_as_largest():
    w = torch.randn(300, 64, device=DEV)
    w[250] = float("nan")
    got = matvec_argmax(torch.randn(1, 64, device=DEV), w, Tiling(32, 32, 1, 4, 2))
    assert got.tolist() == [250]


def test_argmax_scratch_is_left_as_found_so_launches_can_share_it():
    """One persistent scratch across launches of different rows and weights (as a replayed
    graph reuses it): each result is right, and each launch resets what it used."""
    torch.manual_seed(3)
    scratch = ArgmaxScratch(DEV)
    for m, n in ((3, 300), (1, 257), (5, 300)):
        x, w = torch.randn(m, 64, device=DEV), torch.randn(n, 64, device=DEV)
        got = matvec_argmax(x, w, Tiling(32, 32, 1, 4, 2), scratch)
        assert torch.equal(got, (x @ w.T).argmax(-1))
        assert bool((scratch.best == EMPTY).all()) and scratch.ticket.item() == 0


@pytest.mark.parametrize("temperatures", [(0.0, 0.0), (0.0, 0.7), (1.3, 0.5)])
def test_folded_draw_is_the_sampling_kernels_draw(temperatures):
    """The verify head's draw folded into its matvec: the logits it writes are the plain
    matvec's, each row's token is the sampling kernel's draw from them (greedy rows and
    Gumbel rows keyed by (seed, start + shift + t)), with the row's non-finite count; and the
    scratch is as found once they are taken."""
    torch.manual_seed(7)
    n, w, k, v = 2, 3, 64, 300
    x, weight = torch.randn(n * w, k, device=DEV), torch.randn(v, k, device=DEV)
    weight[40:43] = weight[17]  # ties: the first column wins
    x[4, 0] = float("inf")  # row 4 (request 1, t 1): non-finite logits
    seed = torch.tensor([11, 2**40 + 3], device=DEV)
    start = torch.tensor([5, 900], device=DEV)
    inv_temp = torch.tensor([1 / t if t > 0 else 0.0 for t in temperatures], device=DEV)
    scratch = ArgmaxScratch(DEV)
    tiling = Tiling(32, 32, 1, 4, 2)
    for _ in range(2):  # the second launch reuses the scratch the first left
        values = matvec_draw(x, weight, tiling, scratch, Draw(seed, start, inv_temp, w, shift=1))
        out = scratch.take(n * w)
        assert torch.equal(values, matvec(x, weight, tiling))
        rows = torch.arange(n * w, device=DEV)
        want = sample(values, seed[rows // w], start[rows // w] + 1 + rows % w, inv_temp=inv_temp[rows // w])
        ok = torch.isfinite(values).all(1)
        assert torch.equal(out[0][ok], want[ok]) and not bool(ok[4]) and bool(ok[:4].all())
        assert torch.equal(out[1], (~torch.isfinite(values)).sum(1))
        assert bool((scratch.best == EMPTY).all()) and scratch.ticket.item() == 0 and not bool(scratch.bad.any())


@pytest.mark.parametrize("invariant", [False, True])  # row tiles of 64 (three) or of the invariant form's height
def test_a_draw_past_one_row_tile_folds_every_row(invariant):
    """A verify past MAX_ROWS rows (16 requests of a 16-token window) folds its draws in the
    head's launch too: each row of each row tile gets the sampling kernel's draw, through a
    scratch sized for the rows, left as found once taken."""
    torch.manual_seed(9)
    n, w, k, v = 50, 3, 64, 300
    x, weight = torch.randn(n * w, k, device=DEV), torch.randn(v, k, device=DEV)
    seed = torch.arange(n, device=DEV) * 7 + 1
    start = torch.arange(n, device=DEV) * 3
    inv_temp = torch.where(torch.arange(n, device=DEV) % 2 == 0, 0.0, 1.25)
    scratch = ArgmaxScratch(DEV, n * w)
    tiling = Tiling(32, 32, 1, 4, 2)
    values = matvec_draw(x, weight, tiling, scratch, Draw(seed, start, inv_temp, w, shift=1), invariant)
    out = scratch.take(n * w)
    rows = torch.arange(n * w, device=DEV)
    want = sample(values, seed[rows // w], start[rows // w] + 1 + rows % w, inv_temp=inv_temp[rows // w])
    assert torch.equal(out[0], want) and not bool(out[1].any())
    assert bool((scratch.best == EMPTY).all()) and not bool(scratch.bad.any())
    with pytest.raises(ValueError, match="at most 64 rows"):
        matvec_draw(x, weight, tiling, ArgmaxScratch(DEV), Draw(seed, start, inv_temp, w, shift=1))


def test_lm_logits_match_the_head():
    torch.manual_seed(5)
    head = torch.nn.Linear(256, 1000, bias=False).to(DEV)
    hidden = torch.randn(2, 3, 256, device=DEV)
    got = lm_logits(head, hidden)
    assert got.shape == (2, 3, 1000) and got.dtype == torch.float32
    torch.testing.assert_close(got, head(hidden), rtol=1e-5, atol=1e-4)


def test_logits_a_row_reads_are_the_bits_the_folded_head_gives():
    """With the invariant kernels, a round whose rows read logits (lm_logits) gives every row the
    bits of the rounds that fold their draws into the head (head_draw): whole sums both, so a
    greedy row's token does not depend on whether a batch-mate asked for logprobs."""
    torch.manual_seed(11)
    n, w = 4, 3
    head = torch.nn.Linear(1024, 4096, bias=False).to(DEV)  # invariant_tiling: split 4 of two K steps each
    hidden = torch.randn(n, w, 1024, device=DEV)
    draw = Draw(torch.arange(n, device=DEV) + 1, torch.arange(n, device=DEV) * 5, torch.zeros(n, device=DEV), w, 1)
    scratch = ArgmaxScratch(DEV, n * w)
    folded = head_draw(head, hidden, scratch, draw, invariant=True)
    scratch.take(n * w)
    assert folded is not None and torch.equal(lm_logits(head, hidden, True), folded)
