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
With ``DRAW`` (the verify head) the logits are written and each row's draw is folded the same
way from them as the sampling kernels score them, with its count of non-finite logits; the
kernel after it (the settle) takes them, so no program waits on a ticket.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import overlap
from .sampling import keyed_scores


@dataclass(frozen=True)
class Draw:
    """What a row's draw is keyed by (sampling.accept_matching): row m = request * width + t
    draws at position start[request] + shift + t with seed[request], at inverse temperature
    inv_temp[request] (0: greedy)."""

    seed: Tensor  # [requests] int64
    start: Tensor  # [requests] int64
    inv_temp: Tensor  # [requests] float32
    width: int
    shift: int = 0


@dataclass(frozen=True)
class Tiling:
    block_n: int
    block_k: int
    split: int
    warps: int
    stages: int


MAX_ROWS = 64  # past this many rows a linear layer turns arithmetic-bound: the matrix library's turn
ROW_TILE = 128  # rows a program takes at most in the batch-invariant form (tiles of 16 to 128 rows, by M)
PROGRAMS = 256  # about two per multiprocessor of an H200 (132): enough loads in flight to stream


def interpreted() -> bool:
    """Kernels run through the Triton interpreter (TRITON_INTERPRET=1: CI on the CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def choose_tiling(m: int, n: int, k: int, gated: bool = False) -> Tiling | None:
    """The tiling for x [m, k] @ w.T with n outputs (device_tiling's), or None where the
    matrix library serves better. Under the interpreter, the same split over wider tiles: it
    runs programs one after another, each tile op a Python call, so fewer programs and K steps
    make CI's differential tests several times faster; the GPU tests hold the device tiling
    to the reference, and the kernel tests give explicit tilings."""
    tiling = device_tiling(m, n, k, gated)
    if tiling is None or not interpreted():
        return tiling
    chunk, block_k = k // tiling.split, tiling.block_k
    while block_k < 512 and chunk % (2 * block_k) == 0:
        block_k *= 2
    return Tiling(min(512, max(tiling.block_n, triton.next_power_of_2(n))), block_k, tiling.split, tiling.warps, 1)


def invariant_tiling(n: int, k: int, gated: bool = False) -> Tiling | None:
    """The batch-invariant form's tiling: the device's at one row, so chosen by (N, K) alone
    (K steps, split, column blocks); rows go in tiles of up to ROW_TILE at any M. None for a K the
    matvec cannot step through (the matrix library then serves, without the guarantee). The
    device's K steps under the interpreter too, not choose_tiling's wider ones: its summed tile
    products (tile_dot) must stay within Triton's largest tensor (its column blocks widen
    instead, _interpreted_columns)."""
    return device_tiling(1, n, k, gated)


def device_tiling(m: int, n: int, k: int, gated: bool = False) -> Tiling | None:
    """From a sweep on an H200: 128-wide K steps, three stages; 64
    output columns per program (32 for the gated form, which streams two rows per column);
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
def tile_dot(a, b, acc, PRECISION: tl.constexpr, SUMMED: tl.constexpr):
    """acc + a @ b for tiles a [M, K], b [K, N]: the matrix units' product, or with SUMMED the
    products summed along K one after another, the same for every row of the tile. The
    batch-invariant forms use SUMMED under the interpreter, whose matrix product (numpy's)
    rounds a row differently by where it sits in the tile; on the GPU every row of a tile meets
    the same matrix-unit instruction, which the GPU tests hold."""
    if SUMMED:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return tl.dot(a, b, acc, input_precision=PRECISION)


def summed(invariant: bool) -> bool:
    """tile_dot's SUMMED: the invariant forms under the interpreter."""
    return invariant and interpreted()


@triton.jit
def _epilogue(acc_g, acc_u, out, best, tokens, ticket, bad, seed, start, inv_temp, rm, rn, M, N, W, SHIFT, pk, dt,
              GATED: tl.constexpr, SPLIT: tl.constexpr, ARGMAX: tl.constexpr, DRAW: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] (rows x output columns) -> out: partial sums, or final values
    rounded to the model dtype ``dt`` (then stored as out's dtype: float32 logits need no copy).
    ARGMAX: see _fold. DRAW: the values are stored, and each row's draw is folded (_fold) from
    them as the sampling kernels score them (sampling.keyed_scores), with its non-finite count."""
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if GATED:
        acc_g = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    if ARGMAX:
        _fold(acc_g.to(dt).to(tl.float32), mask, best, tokens, ticket, rm, M, rn, N, bad)
    elif SPLIT == 1:  # int64 offsets: a long prefill's rows x columns pass 2^31
        tl.store(out + rm[:, None].to(tl.int64) * N + rn[None, :], acc_g.to(dt).to(out.dtype.element_ty), mask=mask)
        if DRAW:
            v = acc_g.to(dt).to(tl.float32)
            scores, count = keyed_scores(v, mask, rm, rn, M, W, SHIFT, seed, start, inv_temp)
            _fold(scores, mask, best, tokens, ticket, rm, M, rn, N, bad, count, DRAW=True)
    else:
        tl.store(out + (pk * M + rm[:, None]).to(tl.int64) * N + rn[None, :], acc_g, mask=mask)


@triton.jit
def _mv_rows(x, w, out, best, tokens, ticket, bad, seed, start, inv_temp, M, N, K, CHUNK, W, SHIFT,
             GATED: tl.constexpr, SPLIT: tl.constexpr, ARGMAX: tl.constexpr, DRAW: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
             PDL: tl.constexpr, SUMMED: tl.constexpr = False):
    """Program (row tile, column block, K chunk): BLOCK_N outputs of rows [pm*BLOCK_M, +BLOCK_M) ∩
    [0, M) over K [pk*CHUNK, +CHUNK). Row tiles vary fastest, so the programs reading one
    weight tile run side by side and all but the first find it in L2."""
    pm, pn, pk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = pk * CHUNK + tl.arange(0, BLOCK_K)
    overlap.gate(PDL)
    xp = x + rm[:, None].to(tl.int64) * K + rk[None, :]
    wp = w + rn[:, None].to(tl.int64) * K + rk[None, :]
    up = wp + N.to(tl.int64) * K  # GATED: the up rows sit N rows below the gate rows
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(0, CHUNK, BLOCK_K):
        xt = tl.load(xp, mask=rm[:, None] < M, other=0.0)
        acc_g = tile_dot(xt, tl.trans(tl.load(wp, mask=rn[:, None] < N, other=0.0)), acc_g, PRECISION, SUMMED)
        if GATED:
            acc_u = tile_dot(xt, tl.trans(tl.load(up, mask=rn[:, None] < N, other=0.0)), acc_u, PRECISION, SUMMED)
        xp += BLOCK_K
        wp += BLOCK_K
        up += BLOCK_K
    _epilogue(acc_g, acc_u, out, best, tokens, ticket, bad, seed, start, inv_temp, rm, rn, M, N, W, SHIFT, pk,
              x.dtype.element_ty, GATED, SPLIT, ARGMAX, DRAW)


EMPTY = -(2**63)  # ArgmaxScratch.best between launches: below every packed (value, column)
_EMPTY = tl.constexpr(EMPTY)  # the same, readable inside kernels


@triton.jit
def _fold(v, mask, best, tokens, ticket, rm, M, rn, N, bad, count=0, DRAW: tl.constexpr = False):
    """v [BLOCK_M, BLOCK_N] scores -> each row's largest here (NaN counting as largest, as
    torch.argmax has it) and its first column, packed as (order-keyed value bits << 32) |
    (2^32 - 1 - column) so that one int64 atomic max per row keeps the largest value and, on
    ties, the first column. The last program to finish (a ticket) unpacks each row's winner
    into tokens [M] and leaves ``best`` and ``ticket`` as it found them. A DRAW adds each
    row's ``count`` [BLOCK_M] into bad [M] and leaves both for the kernel after it to take
    (take_draws): no program waits on a ticket's round trip."""
    v = tl.where(mask, tl.where(v != v, float("inf"), v), float("-inf")) + 0.0  # +0.0: no -0 to order below +0
    top = tl.max(v, axis=1)
    first = tl.min(tl.where(v == top[:, None], rn[None, :], N), axis=1)
    bits = top.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)  # float order as signed int order
    packed = (key << 32) | (0xFFFFFFFF - first.to(tl.int64))
    tl.atomic_max(best + rm, packed, mask=rm < M, sem="relaxed", scope="gpu")
    if DRAW:
        tl.atomic_add(bad + rm, count, mask=(rm < M) & (count > 0), sem="relaxed", scope="gpu")
    else:
        tl.debug_barrier()  # every thread's atomic above comes before this program's arrival (a release)
        programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == programs - 1:
            tl.store(tokens + rm, _taken(best, rm, rm < M), mask=rm < M)
            tl.store(ticket, 0)


@triton.jit
def _taken(best, rows, mask):
    """The winners' columns at ``rows`` of ``best``, which is left EMPTY there."""
    won = tl.atomic_xchg(best + rows, tl.full(rows.shape, _EMPTY, tl.int64), mask=mask, sem="relaxed", scope="gpu")
    return 0xFFFFFFFF - (won & 0xFFFFFFFF)


@triton.jit
def take_draws(best, bad, rows, mask):
    """For the kernel after a matvec_draw: (each row's draw, its non-finite count) at ``rows``,
    leaving the scratch's best EMPTY and bad 0 there for the next launch."""
    counted = tl.atomic_xchg(bad + rows, tl.zeros(rows.shape, tl.int32), mask=mask, sem="relaxed", scope="gpu")
    return _taken(best, rows, mask), counted


class ArgmaxScratch:
    """What the one-launch argmax and draw keep between launches: each row's packed best
    (EMPTY), a count of finished programs (0) and each row's count of non-finite values (0).
    Every argmax launch, and every draw with the take after it, leaves them so, hence a graph
    replays them; launches sharing one must run one after another (one stream)."""

    def __init__(self, device: torch.device | str, rows: int = MAX_ROWS):
        self.rows = rows  # a draw's rows at most (an argmax's: MAX_ROWS, one row tile)
        self.best = torch.full((rows,), EMPTY, dtype=torch.int64, device=device)  # [rows]
        self.ticket = torch.zeros(1, dtype=torch.int32, device=device)
        self.bad = torch.zeros(rows, dtype=torch.int32, device=device)  # [rows]

    def take(self, rows: int) -> Tensor:
        """take_draws eagerly: [2, rows] int64 (draws, non-finite counts), the scratch reset."""
        drawn = torch.stack([0xFFFFFFFF - (self.best[:rows] & 0xFFFFFFFF), self.bad[:rows].long()])
        self.best[:rows] = EMPTY
        self.bad[:rows] = 0
        return drawn


WIDE_ROWS = 128  # from this many rows the invariant form runs programs of wider column blocks
WIDE_WEIGHTS = 1 << 22  # ... over weights of at least this many elements (a small model's stay launch-bound)
SMALL_ROW_TILE = 16  # rows a program takes over a smaller weight: more programs, each a shorter chain


def wide(tiling: Tiling, m: int, n: int, k: int, gated: bool, itemsize: int = 2) -> Tiling:
    """The invariant form's program shape for M rows: the one-row tiling's below WIDE_ROWS;
    from there wider column blocks, 64-wide K steps, more warps and stages, which
    bench/gemm_probe.py measured 1.5 to 2 times faster at 256 to 1024 rows on an H200 (within
    1.2 to 1.4 times the matrix library) and bit-equal to the one-row shape: a row's sums take
    the same K chunks, each summed from zero in the same 16-wide steps of the matrix units,
    whatever the block's width or K step (the GPU tests hold it). Under the interpreter the K
    steps stay (its summed tile products depend on them). The shapes are sized for 16-bit
    inputs: float32 tiles would not fit the shared memory, and keep the one-row shape; so do
    weights under WIDE_WEIGHTS elements (the tiny pair's, whose launches cost what their work
    does, measured only with the one-row shape)."""
    if m < WIDE_ROWS or interpreted() or itemsize != 2 or n * k < WIDE_WEIGHTS or (k // tiling.split) % 64:
        return tiling
    if gated or n >= 65536:  # the MLP's two halves, the LM head's many columns
        return replace(tiling, block_n=128, block_k=64, warps=8, stages=4)
    if m < 256:
        return replace(tiling, block_n=128, warps=4, stages=3)
    return replace(tiling, block_n=256, block_k=64, warps=8, stages=4)


def row_tile(m: int, most: int = ROW_TILE) -> int:
    """Rows per program for M rows: the next power of two from 16, at most ``most``."""
    return min(most, max(16, triton.next_power_of_2(m)))


def _interpreted_columns(tiling: Tiling, block_m: int, n: int) -> int:
    """Output columns per program of the invariant form under the interpreter: as many as
    keep a summed tile product (block_m x block_k x columns) within Triton's largest tensor.
    A column's sum never meets another column's, so the block's width changes no result; the
    interpreter pays per program, and the device's 64 columns made most of an interpreted
    test's time."""
    return max(tiling.block_n, min(triton.next_power_of_2(n), (1 << 20) // (block_m * tiling.block_k)))


def _launch(x: Tensor, w: Tensor, out: Tensor, n: int, chunk: int, tiling: Tiling, gated: bool,
            scratch: ArgmaxScratch | None = None, tokens: Tensor | None = None, draw: Draw | None = None,
            invariant: bool = False, most: int = ROW_TILE, as_given: bool = False) -> None:
    """Grid (row tiles, column blocks, K chunks). ``invariant``: any M, rows in tiles of up to
    ``most`` rows (SMALL_ROW_TILE on the GPU over a weight under WIDE_WEIGHTS elements: a 16-row
    verify of the tiny pair ran its matvecs 10% faster than in 128-row tiles), every tile stepping
    through K in the same order (the tiling is chosen by N and K alone). The matrix units round a
    row alike in tiles of 16, 64 and 128 rows (bench/invariance_probe.py and the GPU tests check
    it on the H200), so a row's result does not depend on M. Else tiles of up to MAX_ROWS rows:
    one tile, except for a draw through a larger scratch (matvec_draw), whose rows the next
    kernel takes."""
    m, k = x.shape
    if invariant and not as_given:
        tiling = wide(tiling, m, n, k, gated, x.element_size())
        if n * k < WIDE_WEIGHTS and not interpreted():  # a launch-bound weight: latency, not its stream, counts
            most = min(most, SMALL_ROW_TILE)
    block_m = row_tile(m, most if invariant else MAX_ROWS)
    block_n = _interpreted_columns(tiling, block_m, n) if summed(invariant) else tiling.block_n
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), tiling.split)
    best, ticket, bad = (out, out, out) if scratch is None else (scratch.best, scratch.ticket, scratch.bad)
    d = draw or Draw(out, out, out, 1)  # read only by a draw
    _mv_rows[grid](x, w, out, best, out if tokens is None else tokens, ticket, bad, d.seed, d.start, d.inv_temp, m,
                   n, k, chunk, d.width, d.shift, GATED=gated, SPLIT=tiling.split,
                   ARGMAX=draw is None and tokens is not None, DRAW=draw is not None,
                   BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=tiling.block_k,
                   PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # float32 stays exact for tests
                   num_warps=tiling.warps, num_stages=tiling.stages, SUMMED=summed(invariant),
                   **overlap.launch(release=True))


def matvec(x: Tensor, w: Tensor, tiling: Tiling, gated: bool = False, out_dtype: torch.dtype | None = None,
           invariant: bool = False, most: int = ROW_TILE, as_given: bool = False) -> Tensor:
    """x [M, K] @ w.T for w [N, K] ([2N, K] when gated) -> [M, N] in x's dtype (rounded to it,
    stored as ``out_dtype`` when given), or float32 partial sums [split, M, N] when
    tiling.split > 1 (the consumer adds them). ``invariant``: any M, each row's result
    independent of the others, in tiles of at most ``most`` rows (_launch; a smaller bound is
    for bench/invariance_probe.py, which checks that tiles of every height round alike), in
    programs shaped for M (wide) unless ``as_given`` (bench/gemm_probe.py's candidates)."""
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
    _launch(x, w, out, n, chunk, tiling, gated, invariant=invariant, most=most, as_given=as_given)
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
    _launch(x.contiguous(), w, tokens, n, k, tiling, False, scratch, tokens)
    return tokens


def matvec_draw(x: Tensor, w: Tensor, tiling: Tiling, scratch: ArgmaxScratch, draw: Draw,
                invariant: bool = False) -> Tensor:
    """x [M, K] @ w.T rounded to x's dtype -> those values as float32 [M, N], in one launch
    that also folds each row's draw (sampling.accept_matching's, for row m = request * width
    + t at position start + shift + t) and its count of non-finite values into ``scratch``,
    where the next kernel takes them (take_draws; eagerly, ArgmaxScratch.take). Rows may span
    several row tiles (up to the scratch's rows): no program unpacks the winners, the next
    kernel does."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or tiling.split != 1 or k % tiling.block_k or m > scratch.rows or m % draw.width:
        raise ValueError(f"matvec_draw: x [{m}, {k}] and weight {tuple(w.shape)} need whole sums in "
                         f"{tiling.block_k}-wide steps, at most {scratch.rows} rows, whole windows of {draw.width}")
    values = torch.empty(m, n, dtype=torch.float32, device=x.device)
    _launch(x.contiguous(), w, values, n, k, tiling, False, scratch, draw=draw,
            invariant=invariant)
    return values
