"""Matrix-vector products for decode: y = x @ W.T with few rows in x (one per verified token).

At a handful of rows a linear layer is a stream over its weight, so the whole game is keeping
enough loads in flight on every multiprocessor. The rows of x go as one [BLOCK_M, BLOCK_K] tile
(rows past M masked) against [BLOCK_N, BLOCK_K] weight tiles through the matrix units, whose
pipelined loads stream the weight; the padding rows cost arithmetic, which is idle anyway.
Measured on an H200 this beat both the matrix library and an elementwise one-row form (products
summed once at the end) at every decode shape of an 8B model, one row or sixteen.

The K range may be split over SPLIT programs per output block: each writes a float32 partial sum
[SPLIT, M, N] and the consumer (the next norm, the q/k/v kernel) adds them as it loads, so a
small matrix still spreads over the whole chip without a reduction launch of its own. With
``GATED`` the weight is [gate; up] stacked and each program computes both halves of its
columns, writing silu(gate) * up: the MLP's activation costs no launch either. With ``ARGMAX``
each program folds its columns' largest (rounded) value per row and where it sits into one
int64 per row by an atomic max, and the last program to finish (a ticket) reads the winners
out: a greedy readout through an LM head never writes its logits and needs no second launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import overlap


@dataclass(frozen=True)
class Tiling:
    block_n: int
    block_k: int
    split: int
    warps: int
    stages: int


MAX_ROWS = 64  # past this many rows a linear layer turns arithmetic-bound: the matrix library's turn
PROGRAMS = 256  # about two per multiprocessor of an H200 (132): enough loads in flight to stream


def choose_tiling(m: int, n: int, k: int, gated: bool = False) -> Tiling | None:
    """The tiling for x [m, k] @ w.T with n outputs, or None where the matrix library serves
    better. From a sweep on an H200 (bench/matvec_sweep.py): 128-wide K steps, three stages;
    64 output columns per program (32 for the gated form, which streams two rows per column);
    K split in two or four until about PROGRAMS programs stream the weight."""
    block_k = min(128, k)
    if m > MAX_ROWS or k % block_k or block_k < 16 or block_k & (block_k - 1):
        return None
    if gated:
        return Tiling(32, block_k, 1, 4, 3)
    split = 1
    while triton.cdiv(n, 64) * split < PROGRAMS and split < 4 and k % (2 * split * block_k) == 0:
        split *= 2
    return Tiling(64, block_k, split, 4, 3)


@triton.jit
def _epilogue(acc_g, acc_u, out, idx, ticket, rm, rn, M, N, pk, pn, dt, GATED: tl.constexpr, SPLIT: tl.constexpr,
              ARGMAX: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] (rows x output columns) -> out: partial sums, or final values
    rounded to the model dtype ``dt`` (then stored as out's dtype: float32 logits need no copy).
    ARGMAX: see _argmax_fold."""
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if GATED:
        acc_g = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    if ARGMAX:
        _argmax_fold(acc_g.to(dt).to(tl.float32), mask, out, idx, ticket, rm, rn, M, N)
    elif SPLIT == 1:
        tl.store(out + rm[:, None] * N + rn[None, :], acc_g.to(dt).to(out.dtype.element_ty), mask=mask)
    else:
        tl.store(out + (pk * M + rm[:, None]) * N + rn[None, :], acc_g, mask=mask)


@triton.jit
def _mv_rows(x, w, out, idx, ticket, M, N, K, CHUNK, GATED: tl.constexpr, SPLIT: tl.constexpr, ARGMAX: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
             PDL: tl.constexpr):
    """Program (column block, K chunk): BLOCK_N outputs of rows [0, M) over K [pk*CHUNK, +CHUNK)."""
    pn, pk = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = pk * CHUNK + tl.arange(0, BLOCK_K)
    overlap.gate(PDL)
    xp = x + rm[:, None] * K + rk[None, :]
    wp = w + rn[:, None].to(tl.int64) * K + rk[None, :]
    up = wp + N.to(tl.int64) * K  # GATED: the up rows sit N rows below the gate rows
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(0, CHUNK, BLOCK_K):
        xt = tl.load(xp, mask=rm[:, None] < M, other=0.0)
        acc_g = tl.dot(xt, tl.trans(tl.load(wp, mask=rn[:, None] < N, other=0.0)), acc_g, input_precision=PRECISION)
        if GATED:
            acc_u = tl.dot(xt, tl.trans(tl.load(up, mask=rn[:, None] < N, other=0.0)), acc_u,
                           input_precision=PRECISION)
        xp += BLOCK_K
        wp += BLOCK_K
        up += BLOCK_K
    _epilogue(acc_g, acc_u, out, idx, ticket, rm, rn, M, N, pk, pn, x.dtype.element_ty, GATED, SPLIT, ARGMAX)


EMPTY = -(2**63)  # ArgmaxScratch.best between launches: below every packed (value, column)
_EMPTY = tl.constexpr(EMPTY)  # the same, readable inside kernels


@triton.jit
def _argmax_fold(v, mask, best, tokens, ticket, rm, rn, M, N):
    """v [BLOCK_M, BLOCK_N] rounded products -> each row's largest here (NaN counting as
    largest, as torch.argmax has it) and its first column, packed as (order-keyed
    value bits << 32) | (2^32 - 1 - column) so that one int64 atomic max per row keeps the
    largest value and, on ties, the first column. The last program to finish unpacks each
    row's winner into tokens [M] and leaves ``best`` and ``ticket`` as it found them."""
    v = tl.where(mask, tl.where(v != v, float("inf"), v), float("-inf"))  # sums from +0: never -0
    top = tl.max(v, axis=1)
    first = tl.min(tl.where(v == top[:, None], rn[None, :], N), axis=1)
    bits = top.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)  # float order as signed int order
    packed = (key << 32) | (0xFFFFFFFF - first.to(tl.int64))
    tl.atomic_max(best + rm, packed, mask=rm < M, sem="relaxed", scope="gpu")
    tl.debug_barrier()  # every thread's atomic above comes before this program's arrival (a release)
    if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        empty = tl.full((rm.shape[0],), _EMPTY, tl.int64)
        won = tl.atomic_xchg(best + rm, empty, mask=rm < M, sem="relaxed", scope="gpu")
        tl.store(tokens + rm, 0xFFFFFFFF - (won & 0xFFFFFFFF), mask=rm < M)
        tl.store(ticket, 0)


class ArgmaxScratch:
    """What the one-launch argmax keeps between launches: each row's packed best (EMPTY) and a
    count of finished programs (0). Every launch leaves them so, hence a graph replays them;
    launches sharing one must run one after another (one stream)."""

    def __init__(self, device: torch.device | str):
        self.best = torch.full((MAX_ROWS,), EMPTY, dtype=torch.int64, device=device)  # [MAX_ROWS]
        self.ticket = torch.zeros(1, dtype=torch.int32, device=device)


def _launch(grid: tuple[int, int], x: Tensor, w: Tensor, out: Tensor, idx: Tensor, ticket: Tensor, n: int,
            chunk: int, tiling: Tiling, gated: bool, argmax: bool) -> None:
    m, k = x.shape
    _mv_rows[grid](x, w, out, idx, ticket, m, n, k, chunk, GATED=gated, SPLIT=tiling.split, ARGMAX=argmax,
                   BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k,
                   PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # float32 stays exact for tests
                   num_warps=tiling.warps, num_stages=tiling.stages, **overlap.launch(release=True))


def matvec(x: Tensor, w: Tensor, tiling: Tiling, gated: bool = False, out_dtype: torch.dtype | None = None
           ) -> Tensor:
    """x [M, K] @ w.T for w [N, K] ([2N, K] when gated) -> [M, N] in x's dtype (rounded to it,
    stored as ``out_dtype`` when given), or float32 partial sums [split, M, N] when
    tiling.split > 1 (the consumer adds them)."""
    m, k = x.shape
    n = w.shape[0] // 2 if gated else w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"matvec: x has {k} columns but the weight has {w.shape[1]}")
    if gated and tiling.split > 1:
        raise ValueError("matvec: the gated form needs whole sums (split 1)")
    chunk = k // tiling.split
    if chunk * tiling.split != k or chunk % tiling.block_k:
        raise ValueError(f"matvec: K={k} does not divide into {tiling.split} chunks of {tiling.block_k}-wide steps")
    x = x.contiguous()
    if tiling.split == 1:
        out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    else:
        out = torch.empty(tiling.split, m, n, dtype=torch.float32, device=x.device)
    _launch((triton.cdiv(n, tiling.block_n), tiling.split), x, w, out, out, out, n, chunk, tiling, gated,
            argmax=False)
    return out


def matvec_argmax(x: Tensor, w: Tensor, tiling: Tiling, scratch: ArgmaxScratch | None = None) -> Tensor:
    """argmax over N of x [M, K] @ w.T rounded to x's dtype (the first on ties) -> [M] int64,
    in one launch, without writing the [M, N] products. ``scratch`` is the caller's persistent
    ArgmaxScratch (a graph replays it); without one a fresh one is made."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or tiling.split != 1 or k % tiling.block_k or m > MAX_ROWS:
        raise ValueError(f"matvec_argmax: x [{m}, {k}] and weight {tuple(w.shape)} need whole sums in "
                         f"{tiling.block_k}-wide steps and at most {MAX_ROWS} rows")
    scratch = scratch or ArgmaxScratch(x.device)
    tokens = torch.empty(m, dtype=torch.int64, device=x.device)
    _launch((triton.cdiv(n, tiling.block_n), 1), x.contiguous(), w, scratch.best, tokens, scratch.ticket, n, k,
            tiling, gated=False, argmax=True)
    return tokens
