"""A chain step's input in one launch: its tokens' embedding rows, scaled, beside the previous
step's hidden state (a frozen-KV MTP drafter's pre-projection input, ``[embed(t) * s, h]``),
where an indexing, a multiply and a concatenation took three launches a step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import overlap


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
