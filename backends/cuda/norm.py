"""RMSNorm kernels: a norm with the residual add deferred into it (add_norm), over a linear's
result or its float32 partial sums (added and rounded to the model dtype as they are loaded).
The add's sum is written too: it is the next residual, and a tapped layer's output, which may
go straight into its columns of the features (a strided ``out``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import overlap


@triton.jit
def _summed(a, offsets, mask, stride, dt, PARTS: tl.constexpr):
    """A matmul's output at ``offsets``: one tensor (PARTS 1) or the sum of PARTS float32 partial
    sums ``stride`` apart, rounded to the model dtype as a whole product would be."""
    x = tl.load(a + offsets, mask=mask, other=0.0).to(tl.float32)
    for p in tl.static_range(1, PARTS):  # int64: a long prefill's parts lie past 2^31 elements
        x += tl.load(a + p * stride.to(tl.int64) + offsets, mask=mask, other=0.0)
    return x.to(dt).to(tl.float32)


@triton.jit
def rms_row(s, weight, H, eps, dt):
    """One row's rmsnorm(s) * weight, s [BLOCK] float32 (zero past H), rounded to ``dt`` as the
    eager RMSNorm module rounds: every fused norm's last step (embedding.normed_beside's too)."""
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / H + eps)
    return (weight * (s * rstd).to(dt)).to(dt)


@triton.jit
def _add_norm_kernel(a, h, w, h_out, y_out, H, eps, part, sh, so, HAS_ADD: tl.constexpr, HAS_H: tl.constexpr,
                     PARTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, KEEP: tl.constexpr = False):
    """Row r: s = a + h (rounded to the model dtype, as an eager add is), y = rmsnorm(s) * w.
    Without HAS_H, s = a (its partial sums added and rounded), written to h_out only with KEEP. h and
    h_out rows are ``sh`` and ``so`` apart (a tapped layer's output goes into the features); a's
    partial sums ``part`` elements (rows x H, from the host: past 2^31 in a long prefill)."""
    overlap.gate(PDL)
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < H
    if not HAS_H:
        s = _summed(a, r * H + cols, inside, part, y_out.dtype.element_ty, PARTS)
        if KEEP:
            tl.store(h_out + r * so + cols, s.to(h_out.dtype.element_ty), mask=inside)
    else:
        s = tl.load(h + r * sh + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_ADD and HAS_H:
        s = s + _summed(a, r * H + cols, inside, part, h_out.dtype.element_ty, PARTS)
        s = s.to(h_out.dtype.element_ty)
        tl.store(h_out + r * so + cols, s, mask=inside)
        s = s.to(tl.float32)
    weight = tl.load(w + cols, mask=inside, other=0.0)
    tl.store(y_out + r * H + cols, rms_row(s, weight, H, eps, y_out.dtype.element_ty), mask=inside)


def add_norm(a: Tensor | None, h: Tensor, weight: Tensor, eps: float, out: Tensor | None = None,
             invariant: bool = False) -> tuple[Tensor, Tensor]:
    """(h + a, rmsnorm(h + a) * weight) over rows of h [..., H]; with a None, (h, rmsnorm(h)).
    ``a`` may be a matvec's float32 partial sums [parts, rows, H], added as they are read. The
    sum goes to ``out`` [rows, H] when given (rows may be strided, as h's may), else a new tensor.
    ``invariant``: the warps (and so the reduction's tree) fixed, not chosen by the row count."""
    flat = h.reshape(-1, h.shape[-1])  # a view: a 2-D h keeps its row stride
    rows, width = flat.shape
    parts = 1 if a is None else a.numel() // flat.numel()
    total = flat  # with nothing to add, h is the sum
    if a is not None:
        total = out if out is not None else torch.empty(rows, width, dtype=h.dtype, device=h.device)
    normed = torch.empty(rows, width, dtype=h.dtype, device=h.device)
    _add_norm_kernel[(rows,)](flat if a is None else a, flat, weight, total, normed, width, eps, rows * width,
                              flat.stride(0), total.stride(0), HAS_ADD=a is not None, HAS_H=True, PARTS=parts,
                              BLOCK=triton.next_power_of_2(width),
                              num_warps=norm_warps(rows, invariant), **overlap.launch(release=True))
    return total.view(h.shape), normed.view(h.shape)


def norm_warps(rows: int, invariant: bool = False) -> int:
    """More loads in flight for rows of partial sums; one row's norm is quicker with 4. The
    invariant form keeps 4 at any row count (a row's reduction tree must not depend on it),
    so a decode row costs what it does without the guarantee."""
    return 4 if rows == 1 or invariant else 16


def norm(a: Tensor, weight: Tensor, eps: float, rows: int, keep: Tensor | None = None) -> Tensor:
    """rmsnorm(a) * weight -> [rows, H], where ``a`` is a linear's result [rows, H] or its
    float32 partial sums [parts, rows, H] (added and rounded to the model dtype as read); with
    ``keep`` [rows, H] the rounded sum is written there too (a residual stream's start)."""
    out = torch.empty(rows, weight.shape[0], dtype=weight.dtype, device=a.device)
    width = weight.shape[0]
    _add_norm_kernel[(rows,)](a, a, weight, out if keep is None else keep, out, width, eps, rows * width, width,
                              width if keep is None else keep.stride(0), HAS_ADD=True, HAS_H=False,
                              PARTS=a.numel() // out.numel(), BLOCK=triton.next_power_of_2(weight.shape[0]),
                              num_warps=norm_warps(rows), KEEP=keep is not None, **overlap.launch(release=True))
    return out
