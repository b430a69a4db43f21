"""Block-scaled FP8 products (core/models/fp8.py defines the math): x [M, K] in the model's
dtype against an e4m3 weight [N, K] with a float32 scale per 128 x 128 block.

One kernel serves every row count. Each program streams its weight tiles as e4m3 (half a bf16
weight's bytes) and quantizes its rows of x as it loads them, one 128-wide group per K step
(the checkpoint's dynamic per-token scheme: a group's scale is its largest magnitude over 448),
so the activations cost no launch of their own; the group's e4m3 product goes through the
matrix units and is scaled by both scales into a float32 sum. As in matvec.py the K range may be
split (float32 partial sums that the next norm or q/k/v kernel adds), and the gated form writes
silu(gate) * up. A row's result depends on its own values alone, its groups summed in one order
fixed by the weight's shape, whatever M is: the product is batch-invariant as the bf16 one.

Under Triton's interpreter (CI) rounding to e4m3 is written out (``_to_grid``): its cast rounds
a value that carries into the next binade wrongly (1.95 -> 1); the GPU's cast rounds to nearest
even, as torch does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from draftline.core.models.fp8 import FP8_MAX, MIN_SCALE, Fp8Linear

from . import overlap
from .matvec import MAX_ROWS, PROGRAMS, _epilogue, interpreted, row_tile

GROUP = 128  # a K step: one activation group and one weight block's columns
_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)


@dataclass(frozen=True)
class Fp8Weight:
    """A projection (or several of one input, stacked) as the kernel reads it."""

    weight: Tensor  # [N, K] float8_e4m3fn
    scale: Tensor  # [cdiv(N, scale_rows), cdiv(K, 128)] float32: weight_scale_inv, or one row per weight row
    scale_rows: int  # weight rows per scale row: the checkpoint's block (128), or 1 once rows were stacked unaligned

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def rows_from(self, start: int) -> "Fp8Weight":
        """The rows from ``start`` on (a stacked q/k/v's k and v)."""
        if start % self.scale_rows:
            raise ValueError(f"Fp8Weight.rows_from({start}): not at a scale block's start ({self.scale_rows} rows)")
        return Fp8Weight(self.weight[start:], self.scale[start // self.scale_rows:], self.scale_rows)


def pack(linears: list[Fp8Linear]) -> Fp8Weight:
    """One or more FP8 projections of the same input, stacked: the block scales stay blocks when
    every projection's rows fill whole blocks, else each weight row gets its own scale row."""
    block = linears[0].block[0]
    if any(lin.block != linears[0].block for lin in linears) or linears[0].block[1] != GROUP:
        raise ValueError(f"fp8 projections with blocks {[lin.block for lin in linears]}: the kernel reads "
                         f"{GROUP}-wide column blocks, one size for all")
    weight = torch.cat([lin.weight for lin in linears]) if len(linears) > 1 else linears[0].weight
    aligned = len(linears) == 1 or all(lin.out_features % block == 0 for lin in linears)
    if aligned:
        scale = torch.cat([lin.weight_scale_inv for lin in linears]).contiguous()
    else:
        scale = torch.cat([lin.weight_scale_inv.repeat_interleave(block, 0)[: lin.out_features] for lin in linears])
    start = 0
    for lin in linears:  # each module's tensors become views of the stack: one copy in memory
        lin.weight = weight[start : start + lin.out_features]
        if aligned:
            lin.weight_scale_inv = scale[start // block : (start + lin.out_features + block - 1) // block]
        start += lin.out_features
    return Fp8Weight(weight, scale.contiguous(), block if aligned else 1)


@dataclass(frozen=True)
class Fp8Tiling:
    block_m: int  # rows a program takes
    block_n: int  # output columns a program takes
    split: int  # programs the K range is split over (float32 partial sums past 1)
    warps: int
    stages: int
    swap: bool = False  # weight rows on the matrix units' wide side (acc [BLOCK_N, BLOCK_M])


def fp8_tiling(m: int, n: int, k: int, gated: bool, invariant: bool) -> Fp8Tiling:
    """Decode and verify rows stream the weight with its rows on the matrix units' wide side
    (``swap``): 256 columns a program for tiles of 16 rows (128 gated, or for wider tiles), 8
    warps, 3 stages, K split (up to 8, not gated) until about PROGRAMS programs (from sweeps at
    the 8B's shapes on an H200 and an H100); past MAX_ROWS rows, unless
    invariant, the wide tiles of an arithmetic-bound product. Invariant: 16-row tiles at any M.
    Under the interpreter wider column blocks: it runs programs one by one."""
    groups = triton.cdiv(k, GROUP)
    if m > MAX_ROWS and not invariant:
        return Fp8Tiling(128, 64 if gated else 128, 1, 8, 3)
    block_m = row_tile(m, 16 if invariant else MAX_ROWS)
    block_n, split = 128 if gated or block_m > 16 else 256, 1
    while not gated and triton.cdiv(n, block_n) * split < PROGRAMS and split < 8 and groups % (2 * split) == 0:
        split *= 2
    if interpreted():
        block_n = max(block_n, min(256, triton.next_power_of_2(n)))
    return Fp8Tiling(block_m, block_n, split, 8, 3, swap=True)


@triton.jit
def _to_grid(v):
    """Float32 values within ±448 -> the nearest e4m3 value (ties to even), still float32: an
    add and subtract of 1.5 * 2^(u + 23) rounds to multiples of 2^u, the value's e4m3 spacing
    (2^(e - 3) in binade e, 2^-9 below the smallest normal)."""
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    u = tl.maximum(e, -6) - 3
    magic = ((u + 150) << 23 | 0x400000).to(tl.float32, bitcast=True)
    return (v + magic) - magic


@triton.jit
def _quantized(x, rm, rk, M, K, EXACT_CAST: tl.constexpr):
    """Rows rm x columns rk (one group) of x -> (e4m3 values, each row's float32 scale). Rows
    past M read row M - 1 again (their results are never stored): a row mask on the load made
    a product of fewer rows than the tile twice as slow as a full tile."""
    rows = tl.minimum(rm, M - 1)
    xt = tl.load(x + rows[:, None].to(tl.int64) * K + rk[None, :], mask=rk[None, :] < K, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(xt), axis=1), _MAX), _MIN_SCALE)
    q = tl.minimum(tl.maximum(tl.math.div_rn(xt, scale[:, None]), -_MAX), _MAX)
    if EXACT_CAST:  # the GPU's conversion rounds to nearest even
        return q.to(tl.float8e4nv), scale
    return _to_grid(q).to(tl.float8e4nv), scale


@triton.jit
def _group(q, sx, w, s, rows, rk, END, K, G, SCALE_ROWS: tl.constexpr, g):
    """One group's scaled product: q [BM, GROUP] e4m3 against weight rows ``rows`` -> float32
    [BM, BN] (rows from END on read as zero)."""
    wt = tl.load(w + rows[:, None].to(tl.int64) * K + rk[None, :], mask=(rows[:, None] < END) & (rk[None, :] < K),
                 other=0.0)
    sw = tl.load(s + (rows // SCALE_ROWS) * G + g, mask=rows < END, other=0.0)
    return tl.dot(q, tl.trans(wt)) * sx[:, None] * sw[None, :]


@triton.jit
def _group_swapped(q, sx, w, s, rows, rk, END, K, G, SCALE_ROWS: tl.constexpr, g):
    """_group with the operands swapped: weight rows ``rows`` against q -> float32 [BN, BM], so
    the weight's rows fill the matrix units' wide side and the few activation rows the narrow one."""
    wt = tl.load(w + rows[:, None].to(tl.int64) * K + rk[None, :], mask=(rows[:, None] < END) & (rk[None, :] < K),
                 other=0.0)
    sw = tl.load(s + (rows // SCALE_ROWS) * G + g, mask=rows < END, other=0.0)
    return tl.dot(wt, tl.trans(q)) * sw[:, None] * sx[None, :]


@triton.jit
def _fp8_rows(x, w, s, out, M, N, K, G, GROUPS_PER_SPLIT,
              GATED: tl.constexpr, SPLIT: tl.constexpr, SCALE_ROWS: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EXACT_CAST: tl.constexpr, PDL: tl.constexpr,
              SWAP: tl.constexpr):
    """Program (row tile, column block, K split): BLOCK_N outputs of BLOCK_M rows over groups
    [pk * GROUPS_PER_SPLIT, +GROUPS_PER_SPLIT). Row tiles vary fastest: the programs reading one
    weight tile run side by side. The two orientations keep a loop each (their accumulators
    differ in shape)."""
    pm, pn, pk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    overlap.gate(PDL)
    first = pk * GROUPS_PER_SPLIT
    if SWAP:  # accumulated transposed: [BLOCK_N, BLOCK_M]
        acc_gt = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        acc_ut = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for g in range(first, first + GROUPS_PER_SPLIT):
            rk = g * 128 + tl.arange(0, 128)
            q, sx = _quantized(x, rm, rk, M, K, EXACT_CAST)
            acc_gt += _group_swapped(q, sx, w, s, rn, rk, N, K, G, SCALE_ROWS, g)
            if GATED:
                acc_ut += _group_swapped(q, sx, w, s, rn + N, rk, 2 * N, K, G, SCALE_ROWS, g)
        acc_g = tl.trans(acc_gt)
        acc_u = tl.trans(acc_ut)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for g in range(first, first + GROUPS_PER_SPLIT):
            rk = g * 128 + tl.arange(0, 128)
            q, sx = _quantized(x, rm, rk, M, K, EXACT_CAST)
            acc_g += _group(q, sx, w, s, rn, rk, N, K, G, SCALE_ROWS, g)
            if GATED:  # the up rows sit N rows below the gate rows
                acc_u += _group(q, sx, w, s, rn + N, rk, 2 * N, K, G, SCALE_ROWS, g)
    _epilogue(acc_g, acc_u, out, out, out, out, out, out, out, out, rm, rn, M, N, 1, 0, pk,
              x.dtype.element_ty, GATED, SPLIT, False, False)


def fp8_product(x: Tensor, w: Fp8Weight, gated: bool = False, out_dtype: torch.dtype | None = None,
                invariant: bool = False, tiling: Fp8Tiling | None = None) -> Tensor:
    """x [M, K] @ dequantized(w).T -> [M, N] rounded to x's dtype (stored as ``out_dtype`` when
    given), or float32 partial sums [split, M, N] for the next norm or q/k/v kernel to add.
    ``gated``: w is [gate; up] and the result silu(gate) * up. ``invariant``: row tiles of 16 at
    any M, so a row's products meet the matrix units in the same shape however many rows run.
    ``tiling``: fp8_tiling's unless given (a probe's candidates)."""
    m, k = x.shape
    rows, cols = w.shape
    n = rows // 2 if gated else rows
    if cols != k:
        raise ValueError(f"fp8_product: x has {k} columns but the weight has {cols}")
    if gated and (rows % 2 or n % w.scale_rows and w.scale_rows > 1):
        raise ValueError(f"fp8_product: a gated weight of {rows} rows does not split into gate and up "
                         f"at a {w.scale_rows}-row scale block")
    t = tiling or fp8_tiling(m, n, k, gated, invariant)
    split, groups = t.split, triton.cdiv(k, GROUP)
    if groups % split or (gated and split > 1):
        raise ValueError(f"fp8_product: {groups} groups of K do not split into {split} (gated: whole sums only)")
    x = x.contiguous()
    if split == 1:
        out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    else:
        out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n), split)
    _fp8_rows[grid](x, w.weight, w.scale, out, m, n, k, w.scale.shape[1], groups // split,
                    GATED=gated, SPLIT=split, SCALE_ROWS=w.scale_rows, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
                    EXACT_CAST=not interpreted(), SWAP=t.swap,
                    num_warps=t.warps, num_stages=t.stages, **overlap.launch(release=True))
    return out
