"""Sliding-window attention over the static KV cache, for drafter layers that slide.

A windowed layer's queries see only keys at absolute positions lo ..= hi, with
lo = min(own, anchor) - window + 1, where the anchor is the query itself (a causal layer, or
the z-lab DFlash sliding layer), the position just before a DFlash block (the speculators
dialect: the block sees the last ``window`` context positions, then itself), or a per-row
position (an EAGLE-3 chain's start: its later steps keep the window the chain began with);
hi is the query itself when causal, else the row's last key. The window is a per-layer
constant, so one program per (row, kv head) walks only the keys from the row's lowest lo
on, never the whole cache: a window bounds the work, and no split is needed. Shapes are
fixed by (rows, W, cache); kv_len, slots and the anchors are read on the device, so the
launch is graph-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import overlap
from .pages import Pages, launch_args, page_size, paged

ANCHOR_OWN, ANCHOR_BLOCK, ANCHOR_ROW = 0, 1, 2  # where a query's window is measured from (see Window)


@dataclass(frozen=True)
class Window:
    """One layer's sliding window as a drafter's attention applies it."""

    size: int  # keys a query sees back from its anchor, the anchor included
    causal: bool  # a query sees no key past its own position
    anchor: int = ANCHOR_OWN  # ANCHOR_OWN: the query; ANCHOR_BLOCK: the position before the block; ANCHOR_ROW: rows
    rows: Tensor | None = None  # [N] int64 per-row anchors (ANCHOR_ROW): queries past one keep its window


@triton.jit
def _window_kernel(q, k_cache, v_cache, slots, kv_len, table, ts, anchors, o, scale, HKV, W, G, window,
                   sc_page, sc_head, sc_pos, sq_n, sq_h, sq_t, so_n, so_h, so_t,
                   CAUSAL: tl.constexpr, ANCHOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   D: tl.constexpr, PRECISION: tl.constexpr, PAGE: tl.constexpr, PDL: tl.constexpr):
    """Program (row n, kv head h): the G*W query rows of h's query heads over the keys their
    windows leave them, online softmax in float32 -> o [N, Hq, W, D] (any strides, unit on D)."""
    overlap.gate(PDL)
    pid = tl.program_id(0)
    n, h = pid // HKV, pid % HKV
    m = tl.arange(0, BLOCK_M)  # query row = g * W + t
    d = tl.arange(0, D)
    rows = G * W
    q_row = n * sq_n + (h * G + m // W) * sq_h + (m % W) * sq_t  # [BLOCK_M]
    q_tile = tl.load(q + q_row[:, None] + d[None, :], mask=m[:, None] < rows, other=0.0)
    length = tl.load(kv_len + n)
    own = length - W + m % W  # [BLOCK_M] each query's own position
    if ANCHOR == 1:
        anchor = own * 0 + (length - W - 1)  # the position before the block
    elif ANCHOR == 2:
        anchor = own * 0 + tl.load(anchors + n)
    else:
        anchor = own
    lo = tl.minimum(own, anchor) - window + 1  # [BLOCK_M] first visible key of each query
    first = tl.maximum(tl.min(tl.where(m < rows, lo, length), axis=0), 0)
    slot = tl.load(slots + n).to(tl.int64)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for start in range(first, length, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        inside = j < length
        at = (paged(table, ts, slot, j.to(tl.int64), inside, PAGE, sc_page, sc_pos) + h * sc_head)[:, None] + d[None, :]
        k_tile = tl.load(k_cache + at, mask=inside[:, None], other=0.0)
        scores = tl.dot(q_tile, tl.trans(k_tile), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        visible = inside[None, :] & (j[None, :] >= lo[:, None])
        if CAUSAL:
            visible = visible & (j[None, :] <= own[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_tile = tl.load(v_cache + at, mask=inside[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_row = n * so_n + (h * G + m // W) * so_h + (m % W) * so_t
    tl.store(o + o_row[:, None] + d[None, :], out.to(o.dtype.element_ty), mask=(m < rows)[:, None])


def attend_window(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, kv_len: Tensor, window: Window,
                  out: Tensor | None = None, pages: Pages | None = None) -> Tensor:
    """q [N, Hq, W, D] (rotated; any strides, unit on D) over each row's cached keys, already
    stored (in ``pages``, as attention.attend reads them), through ``window`` -> out [N, Hq, W,
    D] in q's dtype (a view of [N, W, Hq, D] memory, as attention.attend gives it)."""
    pages = Pages.of(k_cache, pages)
    n, hq, w, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    block_m = max(16, triton.next_power_of_2(g * w))
    if window.anchor == ANCHOR_ROW and (window.rows is None or window.rows.shape[0] < n):
        raise ValueError(f"attend_window: a row-anchored window needs one anchor per row ({n} rows)")
    if q.stride(3) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(n, w, hq, d, dtype=q.dtype, device=q.device).transpose(1, 2)
    anchors = window.rows if window.anchor == ANCHOR_ROW else kv_len  # not read unless ANCHOR_ROW
    _window_kernel[(n * hkv,)](
        q, k_cache, v_cache, slots, kv_len, *launch_args(pages), anchors, out, d**-0.5, hkv, w, g, window.size,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), q.stride(0), q.stride(1), q.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        CAUSAL=window.causal, ANCHOR=window.anchor, BLOCK_M=block_m, BLOCK_N=64 if block_m <= 64 else 32, D=d,
        PAGE=page_size(pages),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 stays exact for differential tests
        num_warps=4 if block_m <= 64 else 8, **overlap.launch(release=False))
    return out


def window_mask(own: Tensor, keys: Tensor, window: Window, row: int = 0) -> Tensor:
    """The same visibility as a boolean mask, for the eager (PyTorch) paths: own [T, 1] each
    query's position, keys [1, S] key positions; ``row`` picks a per-row anchor -> [T, S]."""
    if window.anchor == ANCHOR_ROW:
        anchor = own.clamp(max=int(window.rows[row]))
    elif window.anchor == ANCHOR_BLOCK:
        anchor = own.clamp(max=int(own.min()) - 1)
    else:
        anchor = own
    visible = keys > anchor - window.size
    return visible & (keys <= own) if window.causal else visible


def layer_windows(sizes: dict[int, int] | None, causal: bool, anchor: Tensor | None = None,
                  block_causal: bool = False, per_query: bool = False) -> dict[int, Window]:
    """A drafter's sliding layers (layer -> window, as its config gives them) as the windows
    its attention applies, from the same arguments the reference backend's KV store takes:
    causal attention (an EAGLE-3 head) measured from each query or from per-row ``anchor``
    [N]; non-causal (a DFlash block) from the block's start (``block_causal``: the block
    causal too), or, ``per_query``, from each query, causally (the z-lab dialect)."""
    def one(size: int) -> Window:
        if causal:
            return Window(size, True, ANCHOR_OWN if anchor is None else ANCHOR_ROW, anchor)
        if per_query:
            return Window(size, True, ANCHOR_OWN)
        return Window(size, block_causal, ANCHOR_BLOCK)
    return {layer: one(size) for layer, size in (sizes or {}).items()}
