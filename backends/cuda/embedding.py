"""A chain step's input in one launch: its tokens' embedding rows, scaled, beside the previous
step's hidden state (a frozen-KV MTP drafter's pre-projection input, ``[embed(t) * s, h]``),
where an indexing, a multiply and a concatenation took three launches a step; or both normed
(an EAGLE-3 head's layer input, ``[norm_a(embed(t)), norm_b(h)]``), where an indexing and two
norms took three."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import overlap
from .norm import norm_warps, rms_row


@triton.jit
def _beside_kernel(table, ids, other, out, scale, H, F, so, BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr,
                   PDL: tl.constexpr):
    """Row r: out[r] = [table[ids[r]] * scale (rounded to the table's dtype, as an eager multiply
    by a number is), other[r]]."""
    overlap.gate(PDL)
    r = tl.program_id(0).to(tl.int64)
    token = tl.load(ids + r).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    row = tl.load(table + token * H + h, mask=h < H, other=0.0).to(tl.float32) * scale
    tl.store(out + r * (H + F) + h, row.to(out.dtype.element_ty), mask=h < H)
    f = tl.arange(0, BLOCK_F)
    tl.store(out + r * (H + F) + H + f, tl.load(other + r * so + f, mask=f < F, other=0.0), mask=f < F)


def embed_beside(table: Tensor, ids: Tensor, scale: float, other: Tensor) -> Tensor:
    """table [V, H], ids [...] int64, other [..., F] -> [..., H + F]: each id's row of the table
    times ``scale``, then its row of ``other`` (in the table's dtype, which ``other`` shares)."""
    rows = ids.numel()
    if other.shape[:-1] != ids.shape or other.dtype != table.dtype:
        raise ValueError(f"embed_beside: other {tuple(other.shape)} {other.dtype} does not follow ids "
                         f"{tuple(ids.shape)} and the table's {table.dtype}")
    flat = other.reshape(rows, other.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    width, features = table.shape[1], flat.shape[1]
    out = torch.empty(*ids.shape, width + features, dtype=table.dtype, device=table.device)
    _beside_kernel[(rows,)](table, ids.contiguous(), flat, out, scale, width, features, flat.stride(0),
                            BLOCK_H=triton.next_power_of_2(width), BLOCK_F=triton.next_power_of_2(features),
                            **overlap.launch(release=True))
    return out


@triton.jit
def _normed_beside_kernel(table, ids, other, w_a, w_b, out, H, so, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Row r, half j: out[r, jH:(j + 1)H] = rmsnorm(x) * w for x = table[ids[r]] (j = 0, weight
    w_a) or other[r] (j = 1, w_b), each row normed as fused.norm's kernel norms one."""
    overlap.gate(PDL)
    r = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    inside = cols < H
    if j == 0:
        src = table + tl.load(ids + r).to(tl.int64) * H
        weight = tl.load(w_a + cols, mask=inside, other=0.0)
    else:
        src = other + r * so
        weight = tl.load(w_b + cols, mask=inside, other=0.0)
    dt = out.dtype.element_ty
    x = tl.load(src + cols, mask=inside, other=0.0).to(tl.float32).to(dt).to(tl.float32)  # as fused.norm reads
    tl.store(out + r * 2 * H + j * H + cols, rms_row(x, weight, H, eps, dt), mask=inside)


def normed_beside(table: Tensor, ids: Tensor, norm_a, other: Tensor, norm_b) -> Tensor:
    """table [V, H], ids [...] int64, other [..., H] -> [..., 2H]: each id's row of the table
    through the RMSNorm module ``norm_a``, then its row of ``other`` through ``norm_b`` (both
    eps: norm_a's), the bits of two fused.norm launches (the same warps for the same rows)."""
    rows, width = ids.numel(), table.shape[1]
    if other.shape != (*ids.shape, width) or other.dtype != table.dtype or norm_a.eps != norm_b.eps:
        raise ValueError(f"normed_beside: other {tuple(other.shape)} {other.dtype} does not follow ids "
                         f"{tuple(ids.shape)} and the table's rows of {width} {table.dtype}, or the norms' eps differ")
    flat = other.reshape(rows, width)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty(*ids.shape, 2 * width, dtype=table.dtype, device=table.device)
    _normed_beside_kernel[(rows, 2)](table, ids.contiguous(), flat, norm_a.weight, norm_b.weight, out, width,
                                     flat.stride(0), norm_a.eps, BLOCK=triton.next_power_of_2(width),
                                     num_warps=norm_warps(rows), **overlap.launch(release=True))
    return out
