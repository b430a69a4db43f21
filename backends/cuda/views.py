"""The keys a forward stores and reads on the cuda backend (its ``Forward.kv``): one cache's
rows, their key counts after the forward, and the mask they attend by; and attention by that
mask over the keys the q/k/v kernel has just stored.

- CAUSAL: each row's W new keys end at its key count; query t sees keys up to its own position
  (a verify window, an EAGLE-3 head's entries). Past LONG_WINDOW query rows a tile (a later
  prompt chunk's head entries) the queries go in windows, each over the keys up to its last.
- BLOCK: a DFlash block over its context, every query seeing every key below the count.
- PREFILL: prompts into empty rows from position 0: PyTorch's attention among each row's own
  keys (the kernels' tile holds a short window only).
- WINDOWS: prompts, or later chunks of them, through the decode kernel's batch-invariant plan,
  ``chunk`` tokens a window, window i seeing the keys up to window_lens[i]: each prompt token
  attends exactly as a decode row at its position would (the invariant prefill).
- FROZEN: queries only, over another model's verified keys of one layer (frozen-KV MTP).
A sliding layer's ``windows`` entry (sliding.py) replaces CAUSAL or BLOCK for that layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import triton
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from .attention import INVARIANT_QUERY_ROWS, attend
from .sliding import Window, attend_window, window_mask

CAUSAL, BLOCK, PREFILL, WINDOWS, FROZEN = "causal", "block", "prefill", "windows", "frozen"
PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
PARTIALS_BYTES = 256 << 20  # an invariant prefill launch's split outputs at most (windows go as rows)
LONG_WINDOW = 64  # query rows (new tokens x heads per KV head) past which causal queries go in windows


@dataclass(frozen=True)
class KVView:
    cache: "StaticKV"  # noqa: F821 (kv.py)
    slots: Tensor  # [N] int64: each row's slot (its line of the page table)
    kv_len: Tensor  # [N] int64: each row's key count once this forward's keys are stored
    mask: str
    windows: dict[int, Window] = field(default_factory=dict)  # a drafter's sliding layers
    read_layer: int = 0  # FROZEN: the cache layer every query layer reads
    window_lens: Tensor | None = None  # WINDOWS: [windows, N] key counts after each window
    chunk: int = 0  # WINDOWS: tokens a window

    def attend(self, q: Tensor, layer: int) -> Tensor:
        """q [N, Hq, W, D] (rotated) of layer ``layer``, its keys stored -> [N, Hq, W, D], a view
        of [N, W, Hq, D] memory (the output projection reads it without a copy)."""
        c, (n, hq, w, _) = self.cache, q.shape
        if self.mask == FROZEN:
            return attend(q, c.k[self.read_layer], c.v[self.read_layer], self.slots, self.kv_len, False, c.splits(n),
                          tickets=c.tickets, pages=c.pages)
        if self.mask == WINDOWS:
            return _prefill_windows(self, q, layer)
        if self.mask == PREFILL:
            return _prefill_sdpa(self, q, layer)
        window = self.windows.get(layer)
        if self.mask == CAUSAL and w * (hq // c.kv_heads) > LONG_WINDOW:
            return _in_windows(self, q, layer)
        if window is not None:
            return attend_window(q, c.k[layer], c.v[layer], self.slots, self.kv_len, window, pages=c.pages)
        return attend(q, c.k[layer], c.v[layer], self.slots, self.kv_len, self.mask == CAUSAL, c.splits(n),
                      tickets=c.tickets, pages=c.pages)


def prefill_view(cache, slots: Tensor, width: int, group: int, start: Tensor | None = None,
                 windows: dict[int, Window] | None = None) -> KVView:
    """Prompts (or with ``start`` [N], chunks from there) of ``width`` tokens into the rows
    ``slots`` of a model with ``group`` query heads a kv head: through the invariant windows
    where the cache is batch-invariant, else PyTorch's attention among each row's own keys."""
    if cache.invariant and not windows:
        return _windows_view(cache, slots, width, max(1, INVARIANT_QUERY_ROWS // group), start)
    if start is not None:
        raise ValueError("a chunk from a later position needs the invariant prefill (model.batch_invariant)")
    lengths = torch.full((slots.shape[0],), width, dtype=torch.int64, device=slots.device)
    return KVView(cache, slots, lengths, PREFILL, windows or {})


def _windows_view(cache, slots: Tensor, width: int, chunk: int, start: Tensor | None) -> KVView:
    n = slots.shape[0]
    ends = torch.arange(chunk, width + chunk, chunk, device=slots.device).clamp(max=width)  # each window's end
    lens = ends.to(torch.int32)[:, None].expand(-1, n)  # [windows, N], once for every layer
    if start is not None:  # a later chunk's windows also see the keys cached before it
        lens = lens + start.to(torch.int32)[None, :]
    lens = lens.contiguous()
    return KVView(cache, slots, lens[-1], WINDOWS, window_lens=lens, chunk=chunk)


def _in_windows(view: KVView, q: Tensor, layer: int) -> Tensor:
    """Causal queries [N, Hq, W, D] too many for one tile, over their keys already stored:
    LONG_WINDOW query rows a launch, each window's queries seeing the keys up to its last."""
    c, (n, hq, w, d) = view.cache, q.shape
    step = max(1, LONG_WINDOW // (hq // c.kv_heads))
    out = torch.empty(n, w, hq, d, dtype=q.dtype, device=q.device).transpose(1, 2)
    k, v, window = c.k[layer], c.v[layer], view.windows.get(layer)
    for a in range(0, w, step):
        b = min(w, a + step)
        lens = view.kv_len - (w - b)
        if window is None:
            attend(q[:, :, a:b], k, v, view.slots, lens, True, c.splits(n), out=out[:, :, a:b], tickets=c.tickets,
                   pages=c.pages)
        else:
            attend_window(q[:, :, a:b], k, v, view.slots, lens, window, out=out[:, :, a:b], pages=c.pages)
    return out


def _prefill_windows(view: KVView, q: Tensor, layer: int) -> Tensor:
    """q [N, Hq, W, D] over the W keys just stored -> [N, Hq, W, D], ``chunk`` tokens a window,
    window i's keys up to window_lens[i]. Whole windows go as rows of one launch (a window of a
    prompt is a row: its slot, its length), as many as keep the launch's partial outputs within
    PARTIALS_BYTES: a long prompt's hundreds of windows take a few launches a layer, not one
    each. Every program computes what it would alone."""
    c, chunk, lens, (n, hq, w, d) = view.cache, view.chunk, view.window_lens, q.shape
    out = torch.empty(n, w, hq, d, dtype=q.dtype, device=q.device).transpose(1, 2)
    k, v, splits = c.k[layer], c.v[layer], c.splits(n)
    whole = w // chunk
    per_row = k.shape[1] * triton.next_power_of_2(splits.count) * (splits.rows or chunk) * d * 4
    per_launch = max(1, PARTIALS_BYTES // (per_row * n))  # windows a launch
    for first in range(0, whole, per_launch):
        m = min(whole, first + per_launch) - first
        span = slice(first * chunk, (first + m) * chunk)
        rows = q[:, :, span].reshape(n, hq, m, chunk, d).permute(2, 0, 1, 3, 4).reshape(m * n, hq, chunk, d)
        done = attend(rows, k, v, view.slots.repeat(m), lens[first : first + m].reshape(-1), True, c.splits(m * n),
                      pages=c.pages)  # its programs for m * n rows
        out[:, :, span] = done.reshape(m, n, hq, chunk, d).permute(1, 2, 0, 3, 4).reshape(n, hq, m * chunk, d)
    if w % chunk:  # the last window, shorter
        tail = slice(whole * chunk, w)
        attend(q[:, :, tail], k, v, view.slots, lens[whole], True, splits, out=out[:, :, tail], tickets=c.tickets,
               pages=c.pages)
    return out


def _prefill_sdpa(view: KVView, q: Tensor, layer: int) -> Tensor:
    """Prompts from position 0: PyTorch's attention of q [N, Hq, W, D] over each row's first W
    keys (read back from the cache), causal, a sliding layer's window masked."""
    w = q.shape[2]
    k, v = view.cache.rows(layer, view.slots, w)
    window = view.windows.get(layer)
    if window is None:
        return causal_sdpa(q, k, v)
    at = torch.arange(w, device=q.device)
    return causal_sdpa(q, k, v, window_mask(at[:, None], at[None, :], window))


def causal_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """PyTorch's attention over whole prompts (q [N, Hq, T, D], k/v [N, Hkv, S, D]), the kv
    heads repeated for the query groups. Not cuDNN's kernel: it builds a plan per new shape on
    the request path."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    with sdpa_kernel(PREFILL_SDPA):
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
