"""The decode matvec kernels against x @ W.T, and the consumers of their partial sums. Without
a GPU they run in the Triton interpreter (TRITON_INTERPRET=1)."""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
pytest.importorskip("triton")

from backends.cuda.fused import add_norm, linear, lm_logits  # noqa: E402
from backends.cuda.matvec import Tiling, choose_tiling, matvec  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


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
    assert choose_tiling(65, 4096, 4096) is None  # arithmetic-bound: cuBLAS
    assert choose_tiling(1, 4096, 100) is None  # K not a multiple of a power-of-two step
    o = choose_tiling(1, 4096, 4096)
    assert o.split == 4 and o.block_k == 128  # 64 column blocks x 4 K chunks
    assert choose_tiling(1, 151936, 4096).split == 1  # plenty of column blocks already
    assert choose_tiling(16, 12288, 4096, gated=True).split == 1


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


def test_lm_logits_match_the_head():
    torch.manual_seed(5)
    head = torch.nn.Linear(256, 1000, bias=False).to(DEV)
    hidden = torch.randn(2, 3, 256, device=DEV)
    got = lm_logits(head, hidden)
    assert got.shape == (2, 3, 1000) and got.dtype == torch.float32
    torch.testing.assert_close(got, head(hidden), rtol=1e-5, atol=1e-4)
