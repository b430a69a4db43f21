"""Decoder stacks with fused kernels: the same weights and math as draftline.core.models.layers, in eight
or nine launches per layer instead of about sixty. The cuda backend's attention metadata
offers this as ``decoder_stack``, and the target and drafters built from DecoderLayers use it
when given.

Per layer: add+RMSNorm, the QKV matvec, q/k-norm + RoPE + KV store, attention (its splits,
then a combine kernel, or the last split merging them when there are four or fewer), the
output matvec, add+RMSNorm, the gate-up matvec writing SiLU·up, the down matvec (matvec.py;
the matrix library past its row limit). A matvec may leave float32 partial sums; the norm and
q/k/v kernels add them as they load. The residual add of each block is deferred into the next
norm, whose kernel also writes the sum: that sum is the layer's output hidden state, so a
tapped layer's norm writes it straight into its columns of the features (no concatenation).
q/k/v and gate/up weights are concatenated once, and the modules' own weights become views
into them, so the eager modules (prefill) and this path share one copy.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from draftline.core.contract import head_argmax as plain_head_argmax
from draftline.core.models.layers import DecoderLayer, RMSNorm, Rotary

from . import overlap
from .attention import attend
from .matvec import (MAX_ROWS, WIDE_WEIGHTS, ArgmaxScratch, Draw, Tiling, choose_tiling, interpreted,
                     invariant_tiling, matvec, matvec_argmax, matvec_draw)
from .pages import launch_args, page_size, paged
from .sliding import Window, attend_window

if TYPE_CHECKING:
    from .kv import StaticKV


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


@triton.jit
def _qkv_kernel(qkv, q_norm, k_norm, inv_freq, positions, q_out, k_cache, v_cache, slots, kv_len, table, ts,
                HQ, HKV, W, eps, sc_page, sc_head, sc_pos, part_stride, N_TOK,
                QK_NORM: tl.constexpr, PARTS: tl.constexpr, D: tl.constexpr, HEADS: tl.constexpr,
                TOKENS: tl.constexpr, PAGE: tl.constexpr, PDL: tl.constexpr):
    """Program (block of TOKENS tokens, block of HEADS heads) of the fused QKV output (PARTS
    partial sums of it), one tile row per (token, head): q heads are normed, rotated and written
    as [N, W, Hq, D]; k heads normed, rotated and stored in the cache; v heads stored. Each
    head's math is the same whatever TOKENS and HEADS are."""
    overlap.gate(PDL)
    r = tl.arange(0, TOKENS * HEADS)  # [R]: the tile's rows
    tok = tl.program_id(0).to(tl.int64) * TOKENS + r // HEADS
    head = tl.program_id(1) * HEADS + r % HEADS
    real = tok < N_TOK
    n, t = tok // W, tok % W
    half = tl.arange(0, D // 2)
    is_q = (head < HQ) & real
    is_k = (head >= HQ) & (head < HQ + HKV) & real
    is_v = (head >= HQ + HKV) & (head < HQ + 2 * HKV) & real
    live = (is_q | is_k | is_v)[:, None] & (half < D)[None, :]  # [R, D/2]
    at = tok[:, None] * (HQ + 2 * HKV) * D + head.to(tl.int64)[:, None] * D + half[None, :]
    dt = q_out.dtype.element_ty
    x1 = _summed(qkv, at, live, part_stride, dt, PARTS)
    x2 = _summed(qkv, at + D // 2, live, part_stride, dt, PARTS)
    pos = tl.load(positions + tok, mask=real, other=0)
    slot = tl.load(slots + n, mask=real, other=0).to(tl.int64)
    cache_pos = (tl.load(kv_len + n, mask=real, other=0) - W + t).to(tl.int64)
    v1, v2 = x1, x2  # v heads: stored as they are
    if QK_NORM:  # q and k heads: per-head RMSNorm with their own weight
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)  # [R]
        w1 = tl.where(is_q[:, None], tl.load(q_norm + half)[None, :], tl.load(k_norm + half)[None, :])
        w2 = tl.where(is_q[:, None], tl.load(q_norm + D // 2 + half)[None, :], tl.load(k_norm + D // 2 + half)[None, :])
        x1 = (w1 * (x1 * rstd[:, None]).to(dt)).to(tl.float32)
        x2 = (w2 * (x2 * rstd[:, None]).to(dt)).to(tl.float32)
    freq = pos.to(tl.float32)[:, None] * tl.load(inv_freq + half)[None, :]  # RoPE, rotate-half
    cos = tl.cos(freq).to(dt).to(tl.float32)
    sin = tl.sin(freq).to(dt).to(tl.float32)
    o1, o2 = (x1 * cos - x2 * sin).to(dt), (x2 * cos + x1 * sin).to(dt)
    row = head.to(tl.int64)[:, None]
    q_dst = q_out + (tok[:, None] * HQ + row) * D + half[None, :]
    tl.store(q_dst, o1, mask=live & is_q[:, None])
    tl.store(q_dst + D // 2, o2, mask=live & is_q[:, None])
    stored = (is_k | is_v) & (cache_pos >= 0)
    cached = paged(table, ts, slot, cache_pos, stored, PAGE, sc_page, sc_pos)[:, None] + half[None, :]
    k_dst = k_cache + cached + (row - HQ) * sc_head
    tl.store(k_dst, o1, mask=live & (is_k & stored)[:, None])
    tl.store(k_dst + D // 2, o2, mask=live & (is_k & stored)[:, None])
    v_dst = v_cache + cached + (row - HQ - HKV) * sc_head
    tl.store(v_dst, v1.to(dt), mask=live & (is_v & stored)[:, None])
    tl.store(v_dst + D // 2, v2.to(dt), mask=live & (is_v & stored)[:, None])


QKV_WARPS = 1  # a GPU program's tile (at most QKV_TILE elements) is one warp's
QKV_TILE = 128  # elements of D/2 half-rows a GPU program holds at most ...
QKV_MOST_HEADS = 4  # ... in at most this many heads: 4 for D 32 (the tiny pair), 2 for D 128 (the 8B)


def qkv_tiles(tokens: int, heads: int, head_dim: int) -> tuple[tuple[int, int], int, int]:
    """(grid, TOKENS, HEADS) of the q/k/v kernel over ``tokens`` rows of ``heads`` heads. On the
    GPU a program holds one token's heads_per_program(heads, head_dim) heads: a shape of the
    model's alone, so a token's bits do not depend on the batch. Under the interpreter, which
    runs programs one after another and pays per tile op, not per element, every head of as
    many tokens as fill 1024 tile rows (64 tokens of 16 heads) goes in one program."""
    if not interpreted():
        per_head = heads_per_program(heads, head_dim)
        return (tokens, triton.cdiv(heads, per_head)), 1, per_head
    per_head = triton.next_power_of_2(heads)
    per_token = min(triton.next_power_of_2(tokens), max(1, 1024 // per_head))
    return (triton.cdiv(tokens, per_token), 1), per_token, per_head


def heads_per_program(heads: int, head_dim: int) -> int:
    """A GPU program's heads, from the model's shape alone (bench/qkv_tiles.py, µs a launch for
    1, 2 and 4 heads a program): the tiny pair at 256 tokens 2.96, 1.69, 1.47 and at 16 tokens
    1.20, 1.17, 1.19; the 8B at 512 tokens 30.3, 15.5, 8.9 but at 1 token 1.13, 1.32, 2.38 (its
    batch-1 step runs 36 of them)."""
    fill = max(1, QKV_TILE // (head_dim // 2))
    return min(triton.next_power_of_2(heads), QKV_MOST_HEADS, fill)


@triton.jit
def _silu_mul_kernel(gu, out, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
    overlap.gate(PDL)
    r, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    inside = cols < I
    g = tl.load(gu + r * 2 * I + cols, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(gu + r * 2 * I + I + cols, mask=inside, other=0.0)
    silu = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    tl.store(out + r * I + cols, silu * u, mask=inside)


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


def linear_norm(x: Tensor, weight: Tensor, norm_weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(h, rmsnorm(h) * norm_weight) for h = x [M, K] @ weight.T rounded to x's dtype: the
    matvec and one norm launch that also writes h (where the matrix library and a norm took two)."""
    h = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    return h, norm(linear(x, weight), norm_weight, eps, x.shape[0], keep=h)


def linear(x: Tensor, weight: Tensor, gated: bool = False, out_dtype: torch.dtype | None = None,
           invariant: bool = False) -> Tensor:
    """x [M, K] @ weight.T through the decode matvec when it applies (the result may then be
    float32 partial sums [parts, M, N]: add_norm and the q/k/v kernel take those), else the
    matrix library. ``gated``: weight is [gate; up] and the result silu(gate) * up. Whole
    results are rounded to x's dtype, then stored as ``out_dtype`` when given. ``invariant``:
    the matvec at every M, its reductions fixed by the weight's shape (matvec.invariant_tiling),
    where the matrix library's algorithm would change with M; a launch-bound weight past the
    matvec's rows takes that form too (launch_bound)."""
    return product(x, weight, gated, out_dtype, invariant or launch_bound(x.shape[0], weight))


def product(x: Tensor, weight: Tensor, gated: bool = False, out_dtype: torch.dtype | None = None,
            invariant: bool = False) -> Tensor:
    """linear's product as asked: the decode matvec up to its rows, else the matrix library's
    (a small weight's too: one product, not partial sums, for callers that want whole values)."""
    n, k = weight.shape[0] // (2 if gated else 1), weight.shape[1]
    tiling = invariant_tiling(n, k, gated) if invariant else choose_tiling(x.shape[0], n, k, gated)
    if tiling is not None:
        return matvec(x, weight, tiling, gated, out_dtype, invariant=invariant)
    y = F.linear(x, weight)
    if gated:
        y = silu_mul(y)
    return y if out_dtype is None else y.to(out_dtype)


def launch_bound(m: int, weight: Tensor) -> bool:
    """Whether x [m, K] @ weight.T past the decode matvec's rows is a small model's product,
    whose launch costs what its work does: the invariant matvec's row tiles then serve it in
    one launch, the gated form's SiLU·up inside, where the matrix library took two (a tiny
    drafter's 16-token blocks at 16 rows: four layers' products a round), and past those rows a
    row's values do not change with M. A large weight's product is arithmetic-bound there: the
    library's."""
    return m > MAX_ROWS and weight.numel() < WIDE_WEIGHTS


def lm_logits(lm_head: torch.nn.Linear, hidden: Tensor, invariant: bool = False) -> Tensor:
    """hidden [..., H] -> float32 logits [..., V], rounded through the model dtype as the
    target's own logits() are (draftline.core.models.target)."""
    if lm_head.bias is not None:
        return lm_head(hidden).float()
    flat = hidden.reshape(-1, hidden.shape[-1])
    whole = _head_tiling(lm_head, flat, True, most=flat.shape[0]) if invariant else None
    if whole is not None:  # the sums head_draw folds (split 1): a row's logits are the same bits in either round
        return matvec(flat, lm_head.weight, whole, out_dtype=torch.float32, invariant=True).view(
            *hidden.shape[:-1], -1)
    out = product(flat, lm_head.weight, out_dtype=torch.float32, invariant=invariant)
    if out.dim() == 3:  # partial sums
        out = out.sum(0).to(hidden.dtype)
    return out.float().view(*hidden.shape[:-1], -1)


def head_argmax(head: torch.nn.Linear, hidden: Tensor, scratch: ArgmaxScratch | None = None) -> Tensor:
    """hidden [..., H] -> [...] int64: argmax of head(hidden) (the first on ties), the products
    rounded to the model dtype as the eager head gives them; no logits are written. The cuda
    backend binds its persistent ``scratch`` (matvec.ArgmaxScratch)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    tiling = _head_tiling(head, flat)
    if tiling is None and head.bias is None:  # no fold (past one row tile: a DFlash block): product, then argmax
        return row_argmax(F.linear(flat, head.weight)).view(hidden.shape[:-1])
    if tiling is None:
        return plain_head_argmax(head, hidden)
    return matvec_argmax(flat, head.weight, tiling, scratch).view(hidden.shape[:-1])


@triton.jit
def _row_argmax_kernel(x, out, N, stride, BLOCK: tl.constexpr):
    """Row r of x: torch.argmax's answer, the first largest value, a NaN counting as largest."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    best = tl.full((), float("-inf"), tl.float32)
    where = tl.full((), 0, tl.int64)
    first_nan = tl.full((), N, tl.int64)
    for start in range(0, N, BLOCK):
        c = start + cols
        v = tl.load(x + r * stride + c, mask=c < N, other=float("-inf")).to(tl.float32)
        nan = v != v
        first_nan = tl.minimum(first_nan, tl.min(tl.where(nan, c, N), axis=0))
        top = tl.max(tl.where(nan, float("-inf"), v), axis=0)
        at = tl.min(tl.where(v == top, c, N), axis=0)
        where = tl.where(top > best, at, where)  # an equal value in a later block is not first
        best = tl.maximum(best, top)
    tl.store(out + r, tl.where(first_nan < N, first_nan, where))


def row_argmax(x: Tensor) -> Tensor:
    """x [M, N] -> [M] int64, as x.argmax(-1) gives it, in one launch of a program a row (the
    library's reduction took 15 us over a 16-row DFlash block's [240, 4096] bf16 logits)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    if x.shape[0]:
        block = min(4096, triton.next_power_of_2(x.shape[1]))
        _row_argmax_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), BLOCK=block)
    return out


def head_draw(head: torch.nn.Linear, hidden: Tensor, scratch: ArgmaxScratch, draw: Draw,
              invariant: bool = False) -> Tensor | None:
    """hidden [N, W, H] -> float32 logits [N, W, V], as lm_logits gives them, in one launch
    that also leaves each row's draw from them (as sampling.accept_matching makes it) and its
    count of non-finite logits in ``scratch`` for the next kernel (matvec.take_draws); None
    where the head is not one whole-sum matvec (the caller then draws from lm_logits)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    tiling = _head_tiling(head, flat, invariant, most=scratch.rows)
    if tiling is None:
        return None
    return matvec_draw(flat, head.weight, tiling, scratch, draw, invariant).view(*hidden.shape[:-1], -1)


def _head_tiling(head: torch.nn.Linear, flat: Tensor, invariant: bool = False, most: int = MAX_ROWS
                 ) -> Tiling | None:
    """The tiling of an LM head over rows flat [M, H] when one whole-sum matvec launch can fold
    its readout (no bias, the decode matvec applies, at most ``most`` rows: an argmax's last
    program unpacks one row tile, a draw's scratch holds its rows), else None. The K split a
    small head would get is dropped: a fold needs whole sums, and one launch serves where the
    matrix library's product and a separate reduction took two (a tiny pair's 4096-token head)."""
    n, k = head.weight.shape
    tiling = invariant_tiling(n, k) if invariant else choose_tiling(flat.shape[0], n, k)
    if head.bias is not None or tiling is None or flat.shape[0] > most:
        return None
    return replace(tiling, split=1)


def silu_mul(gu: Tensor) -> Tensor:
    rows, inter = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gu.dtype, device=gu.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gu, out, inter, BLOCK=block,
                                                        **overlap.launch(release=False))
    return out


def _fuse(linears: list[torch.nn.Linear]) -> Tensor:
    """One weight for several projections of the same input; each module's weight becomes a view."""
    if any(lin.bias is not None for lin in linears):
        raise ValueError("fused projections with biases are not supported")
    fused = torch.cat([lin.weight.data for lin in linears])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = fused[start : start + rows]
        start += rows
    return fused


def fused_weights(layer: torch.nn.Module) -> tuple[Tensor, Tensor]:
    """The layer's [q; k; v] and [gate; up] weights, concatenated once and kept on the layer
    (every engine over these weights shares them; the projections become views)."""
    if getattr(layer, "fused_qkv", None) is None:
        a = layer.self_attn
        layer.fused_qkv = _fuse([a.q_proj, a.k_proj, a.v_proj])
    return layer.fused_qkv, fused_gate_up(layer)


AttendFn = Callable[[Tensor, int], Tensor]  # (rotated q [N, Hq, W, D], layer) -> its output [N, Hq, W, D]


def run_stack(layers, final_norm: RMSNorm, rotary: Rotary, h: Tensor, positions: Tensor, cache: StaticKV,
              slots: Tensor, kv_len: Tensor, causal: bool, taps: tuple[int, ...] = (),
              tapped: Callable[[Tensor], None] | None = None, windows: dict[int, Window] | None = None,
              attention: AttendFn | None = None) -> tuple[Tensor, Tensor | None]:
    """Decoder layers over a static cache: h [N, W, H] at positions [N, W] -> (final-normed
    hidden [N, W, H], the tapped layers' outputs [N, W, len(taps)*H] or None). ``tapped`` is
    called with those outputs as soon as the last tapped layer's is written, while the layers
    after it are still to be launched (work that reads only the taps can start there).
    ``windows``: the layers that attend through a sliding window (a drafter's; sliding.py).
    ``attention``: what each layer attends with, over the keys just stored (the invariant
    prefill's whole-prompt attention), instead of the decode kernel."""
    n, w = positions.shape
    h = h.reshape(n * w, -1)
    width = h.shape[1]
    features = torch.empty(n * w, len(taps) * width, dtype=h.dtype, device=h.device) if taps else None
    cols = [features[:, j * width : (j + 1) * width] for j in range(len(taps))]  # [N*W, H] views
    tap_out = {t: cols[taps.index(t)] for t in taps}  # a layer's output is written where it is first tapped
    if -1 in tap_out:  # tap -1: the embedding output (layer 0's input), which no add+norm writes
        tap_out[-1].copy_(h)
    done = max(taps, default=-1) + 1  # the add+norm opening this layer writes the last tapped output
    pending = None
    for i, layer in enumerate(layers):
        h, x = add_norm(pending, h, layer.input_layernorm.weight, layer.input_layernorm.eps, out=tap_out.get(i - 1),
                        invariant=cache.invariant)
        if i == done:
            _all_tapped(features, cols, taps, tap_out, tapped, n, w)
        h, pending = layer_body(layer, h, x, positions, rotary, cache, i, slots, kv_len, causal,
                                (windows or {}).get(i), attention)
    h, x = add_norm(pending, h, final_norm.weight, final_norm.eps, out=tap_out.get(len(layers) - 1),
                    invariant=cache.invariant)
    if done == len(layers):
        _all_tapped(features, cols, taps, tap_out, tapped, n, w)
    return x.view(n, w, -1), None if features is None else features.view(n, w, -1)


def layer_body(layer, h: Tensor, x: Tensor, positions: Tensor, rotary: Rotary, cache: StaticKV, i: int,
               slots: Tensor, kv_len: Tensor, causal: bool, window: Window | None = None,
               attention: AttendFn | None = None) -> tuple[Tensor, Tensor]:
    """One decoder layer after its input norm: residual h [N*W, H] and normed input x [N*W, In]
    (In may differ from H: an EAGLE-3 head reads 2H) -> (h after attention [N*W, H], the MLP's
    output, maybe float32 partial sums): the layer's output is their sum, which the next
    add_norm makes. Keys go to layer ``i`` of the cache; a sliding ``window`` replaces causal,
    and ``attention`` (run_stack) replaces the decode kernel."""
    n, w = positions.shape
    qkv_w, gate_up_w = fused_weights(layer)
    q = _qkv(layer, linear(x, qkv_w, invariant=cache.invariant), positions, rotary, cache, i, slots, kv_len, n, w)
    if attention is not None:
        out = attention(q, i)
    elif window is not None:
        out = attend_window(q, cache.k[i], cache.v[i], slots, kv_len, window, pages=cache.pages)  # [N, Hq, W, D] view
    else:
        out = attend(q, cache.k[i], cache.v[i], slots, kv_len, causal, cache.splits(n),
                     tickets=cache.tickets, pages=cache.pages)  # [N, Hq, W, D] view
    return _out_and_mlp(layer, out, h, gate_up_w, cache.invariant)


def _out_and_mlp(layer, out: Tensor, h: Tensor, gate_up_w: Tensor, invariant: bool = False
                 ) -> tuple[Tensor, Tensor]:
    """A layer's tail after attention out [N, Hq, W, D] (a view of [N, W, Hq, D] memory): the
    output matvec, add+RMSNorm onto h, the gated MLP -> (h after attention, the MLP's output)."""
    n, _, w, _ = out.shape
    a = linear(out.transpose(1, 2).reshape(n * w, -1), layer.self_attn.o_proj.weight, invariant=invariant)
    h, x = add_norm(a, h, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
                    invariant=invariant)
    gated = linear(x, gate_up_w, gated=True, invariant=invariant)
    return h, linear(gated, layer.mlp.down_proj.weight, invariant=invariant)


def query_layer_body(layer, h: Tensor, x: Tensor, positions: Tensor, rotary: Rotary, cache: StaticKV,
                     kv_layer: int, slots: Tensor, kv_len: Tensor) -> tuple[Tensor, Tensor]:
    """layer_body for a layer whose attention has queries only (a frozen-KV MTP layer): they
    read layer ``kv_layer`` of another model's cache, each row's first kv_len keys, unmasked."""
    n, w = positions.shape
    a = layer.self_attn
    q = _q_only(a, linear(x, a.q_proj.weight), positions, rotary, cache, slots, kv_len, n, w)
    out = attend(q, cache.k[kv_layer], cache.v[kv_layer], slots, kv_len, False, cache.splits(n),
                 tickets=cache.tickets, pages=cache.pages)  # [N, Hq, W, D] view
    return _out_and_mlp(layer, out, h, fused_gate_up(layer))


def _q_only(a, q_proj: Tensor, positions: Tensor, rotary: Rotary, cache: StaticKV, slots: Tensor, kv_len: Tensor,
            n: int, w: int) -> Tensor:
    """The q/k/v kernel over a query-only projection [N*W, Hq*D] (or its partial sums): q-norm,
    RoPE -> q [N, Hq, W, D], a view of [N, W, Hq, D]; nothing is stored."""
    qk_norm = hasattr(a, "q_norm")
    k_cache = cache.k[0]
    q = torch.empty(n, w, a.num_heads, a.head_dim, dtype=k_cache.dtype, device=q_proj.device)
    parts = q_proj.numel() // (n * w * a.num_heads * a.head_dim)
    grid, tokens, heads = qkv_tiles(n * w, a.num_heads, a.head_dim)
    _qkv_kernel[grid](
        q_proj, a.q_norm.weight if qk_norm else q_proj, a.q_norm.weight if qk_norm else q_proj, rotary.inv_freq, positions, q, k_cache, cache.v[0],
        slots, kv_len, *launch_args(cache.pages), a.num_heads, 0, w, a.q_norm.eps if qk_norm else 0.0,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), q_proj.stride(0) if parts > 1 else 0, n * w,
        QK_NORM=qk_norm, PARTS=parts, D=a.head_dim, HEADS=heads, TOKENS=tokens, PAGE=page_size(cache.pages),
        num_warps=QKV_WARPS, **overlap.launch(release=True))
    return q.transpose(1, 2)


def fuse_layer(module: torch.nn.Module) -> None:
    """Concatenate what of a layer's projections fused_weights or fused_gate_up can."""
    if fusable(module):
        fused_weights(module)
    elif _has(getattr(module, "mlp", None), MLP_PROJECTIONS):
        fused_gate_up(module)


def fused_gate_up(layer: torch.nn.Module) -> Tensor:
    """The layer's [gate; up] weight alone (a layer with no k/v projections of its own)."""
    if getattr(layer, "fused_gate_up", None) is None:
        layer.fused_gate_up = _fuse([layer.mlp.gate_proj, layer.mlp.up_proj])
    return layer.fused_gate_up


def fusable(module: torch.nn.Module) -> bool:
    """A layer whose q/k/v and gate/up projections fused_weights can concatenate."""
    return _has(getattr(module, "self_attn", None), ("q_proj", "k_proj", "v_proj", "o_proj")) and \
        _has(getattr(module, "mlp", None), MLP_PROJECTIONS)


MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _has(obj, names: tuple[str, ...]) -> bool:
    return all(hasattr(obj, name) for name in names)


def _all_tapped(features: Tensor | None, cols: list[Tensor], taps: tuple[int, ...], tap_out: dict[int, Tensor],
                tapped: Callable[[Tensor], None] | None, n: int, w: int) -> None:
    """Every tapped layer's output is written: fill the columns of a layer tapped twice, then
    hand the features [N, W, len(taps)*H] to ``tapped``."""
    if features is None:
        return
    for j, t in enumerate(taps):
        if taps.index(t) != j:  # a layer tapped twice
            cols[j].copy_(tap_out[t])
    if tapped is not None:
        tapped(features.view(n, w, -1))


def project_kv_stack(layers, x: Tensor, positions: Tensor, rotary: Rotary, cache: StaticKV, slots: Tensor,
                     kv_len: Tensor, fc: torch.nn.Linear | None = None, hidden_norm: RMSNorm | None = None) -> None:
    """Each layer's k/v projection of the same x [N, W, H] (first ``hidden_norm(fc(x))`` when
    given; k-norm, RoPE at positions [N, W]) stored in that layer's cache at kv_len - W ..
    kv_len - 1: a matvec over the layer's k and v rows of its fused weight, then the q/k/v
    kernel with no q heads. (A DFlash drafter's context: its fc and norm are two launches here.)"""
    n, w = positions.shape
    flat = x.reshape(n * w, -1)
    if (fc is None) != (hidden_norm is None):
        raise ValueError("project_kv_stack: fc and hidden_norm come together (a DFlash drafter's context)")
    if fc is not None:
        flat = norm(linear(flat, fc.weight) if fc.bias is None else fc(flat), hidden_norm.weight, hidden_norm.eps,
                    n * w)
    for i, layer in enumerate(layers):
        a = layer.self_attn
        kv_w = fused_weights(layer)[0][a.num_heads * a.head_dim:]  # [2*Hkv*D, H]: k rows, then v rows
        _qkv(layer, linear(flat, kv_w), positions, rotary, cache, i, slots, kv_len, n, w, with_q=False)


def _qkv(layer: DecoderLayer, qkv: Tensor, positions: Tensor, rotary: Rotary, cache: StaticKV, i: int,
         slots: Tensor, kv_len: Tensor, n: int, w: int, with_q: bool = True) -> Tensor | None:
    """q/k-norm, RoPE and the K/V store for one layer's fused projection [N*W, (Hq+2Hkv)*D]
    (or its partial sums [parts, N*W, ...]) -> q [N, Hq, W, D], a view of [N, W, Hq, D].
    Without ``with_q`` the projection holds only k and v ([N*W, 2Hkv*D]) and nothing returns."""
    a = layer.self_attn
    qk_norm = hasattr(a, "q_norm")
    hq = a.num_heads if with_q else 0
    k_cache = cache.k[i]
    q = torch.empty(n, w, hq, a.head_dim, dtype=k_cache.dtype, device=qkv.device) if with_q else k_cache
    parts = qkv.numel() // (n * w * (hq + 2 * a.num_kv_heads) * a.head_dim)
    grid, tokens, heads = qkv_tiles(n * w, hq + 2 * a.num_kv_heads, a.head_dim)
    _qkv_kernel[grid](
        qkv, a.q_norm.weight if qk_norm else qkv, a.k_norm.weight if qk_norm else qkv, rotary.inv_freq, positions,
        q, k_cache, cache.v[i], slots, kv_len, *launch_args(cache.pages), hq, a.num_kv_heads, w,
        a.k_norm.eps if qk_norm else 0.0, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        qkv.stride(0) if parts > 1 else 0, n * w, QK_NORM=qk_norm, PARTS=parts, D=a.head_dim, HEADS=heads,
        TOKENS=tokens, PAGE=page_size(cache.pages), num_warps=QKV_WARPS, **overlap.launch(release=True))
    return q.transpose(1, 2) if with_q else None
