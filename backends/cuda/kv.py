"""Static KV caches: one preallocated tensor pair per layer, a slot per running request.

A request's keys live at their absolute positions in its slot, and what a query may see is
decided by the row's length alone, so nothing is ever truncated: rejected drafts' keys sit
past the length until the next round writes over them. The last slot is scratch for the
padding rows of a graph bucket.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
import triton
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from .attention import INVARIANT_QUERY_ROWS, CacheAttention, Splits, attend, invariant_split_plan, split_plan, store_kv
from .embedding import embed_beside, normed_beside
from .fused import add_norm, layer_body, linear_norm, norm, project_kv_stack, query_layer_body, run_stack
from .pages import Pages, PageTable
from .sliding import Window, attend_window, layer_windows, window_mask


PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
PARTIALS_BYTES = 256 << 20  # an invariant prefill launch's split outputs at most (windows go as rows)
LONG_WINDOW = 64  # query rows (new tokens x heads per KV head) past which eager attention leaves the decode kernel


def rms_norm(x: Tensor, module) -> Tensor:
    """An RMSNorm module over x [..., H] in one launch (fused.norm): the fused forms' ``norm``."""
    rows = x.numel() // x.shape[-1]
    return norm(x.reshape(rows, -1), module.weight, module.eps, rows).view(x.shape)


class CacheFull(RuntimeError):
    pass


class SlotPool:
    """The free slots of a static cache, lowest first."""

    def __init__(self, num_slots: int, what: str):
        self.free, self.what = list(range(num_slots - 1, -1, -1)), what

    def allocate(self) -> int:
        if not self.free:
            raise CacheFull(f"every {self.what} slot is in use; lower the batch or raise server.max_batch_size")
        return self.free.pop()

    def release(self, slot: int) -> None:
        self.free.append(slot)


def cache_splits(max_len: int, invariant: bool, kv_heads: int, rows: int) -> Splits:
    """How attention splits a row's keys for a batch of ``rows`` over a cache of ``max_len``
    positions (attention.split_plan; the invariant plan's splits do not follow ``rows``, only
    how many programs take them)."""
    if invariant:
        return invariant_split_plan(max_len, rows, kv_heads)
    return split_plan(max_len, rows, kv_heads)


class StaticKV:
    """Per layer K and V [slots + 1, Hkv, max_len, D] (views of one tensor) and the pool of slots. ``invariant``: the
    rows attending through it, and the matvecs of the stack it serves, take the batch-invariant
    kernel forms (model.batch_invariant). With ``paged`` (pages, size) the layers are [pages + 1,
    Hkv, size, D] instead, a pool whose pages slots take as their rows grow (pages.PageTable:
    ``reserve``), so the slots share the KV memory rather than each holding a whole context."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, invariant: bool = False,
                 paged: tuple[int, int] | PageTable | None = None, put=None):
        shape = (num_slots + 1, num_kv_heads, max_len, head_dim)
        self.pager = paged if isinstance(paged, PageTable) else None  # another cache's table: its rows' pages
        if isinstance(paged, tuple):
            pages, size = paged
            self.pager = PageTable(num_slots, -(-max_len // size), pages, size, device, put)
        if self.pager is not None:  # the last page: positions no page holds
            shape = (self.pager.scratch + 1, num_kv_heads, self.pager.size, head_dim)
        # [2, layers, slots + 1 (or pages + 1), Hkv, max_len (or page size), D]: keys then values of every
        # layer in one tensor, so positions move in one copy for all layers (the prefix store's blocks)
        self.data = torch.zeros((2, num_layers) + shape, dtype=dtype, device=device)
        self.k, self.v = list(self.data[0]), list(self.data[1])
        self.max_len, self.kv_heads, self.scratch = max_len, num_kv_heads, num_slots
        self.invariant = invariant
        # [(slots + 1) * Hkv] arrival counts of attention's programs, one per (row, kv head) (attend)
        self.tickets = torch.zeros((num_slots + 1) * num_kv_heads, dtype=torch.int32, device=device)
        self.prefill_tickets = torch.zeros_like(self.tickets)  # the prefills' (apart: prefills_apart)
        self.slots = SlotPool(num_slots, "KV")
        # a static slot's one page is its own
        self.pages = self.pager.pages if self.pager else Pages.identity_of(num_slots + 1, max_len, device)

    def allocate(self) -> int:
        return self.slots.allocate()

    @contextmanager
    def prefills_apart(self):
        """Attention launched inside (a prefill's, eager or captured) counts its programs'
        arrivals in tickets of its own: tickets go by a row's place in its launch, and prefills
        may run beside the rounds (beside.py), whose launches count theirs in ``tickets``."""
        self.tickets, shared = self.prefill_tickets, self.tickets
        try:
            yield
        finally:
            self.tickets = shared

    def reserve(self, slot: int, positions: int) -> None:
        """Room for the slot's positions 0 .. positions - 1 (a static slot has its whole context);
        ``flush`` before the launch that writes them."""
        if self.pager is not None:
            self.pager.reserve(slot, positions)  # at most a row's pages

    def flush(self) -> None:
        if self.pager is not None:
            self.pager.flush()

    def release(self, slot: int) -> None:
        if self.pager is not None:
            self.pager.release(slot)
        self.slots.release(slot)

    def splits(self, rows: int) -> Splits:
        return cache_splits(self.max_len, self.invariant, self.kv_heads, rows)

    def attention(self, slots: Tensor, kv_len: Tensor, causal: bool) -> CacheAttention:
        return CacheAttention(self.k, self.v, slots, kv_len, causal, self.splits(slots.shape[0]), self.tickets,
                              self.pages)

    def prefill_attention(self, slots: Tensor, windows: dict[int, Window] | None = None,
                          start: Tensor | None = None) -> "PrefillAttention":
        """Prompts from position 0, or with ``start`` [N] chunks from there (the invariant form's,
        which attends over the keys already cached: CudaBackend.chunked_prefill)."""
        if self.invariant and not windows:
            return InvariantPrefill(self, slots, start=start)
        if start is not None:
            raise ValueError("a chunk from a later position needs the invariant prefill (model.batch_invariant)")
        return PrefillAttention(self, slots, windows or {})


@dataclass(frozen=True)
class PrefillAttention:
    """Whole prompts [N, P] into empty slots: causal attention among each row's own tokens,
    keys stored at positions 0 .. P - 1 of its slot; a sliding layer's ``windows`` entry
    masks each query to its window."""

    cache: StaticKV
    slots: Tensor  # [N] int64
    windows: dict[int, Window] = field(default_factory=dict)

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n = k.shape[2]
        lengths = torch.full((k.shape[0],), n, dtype=torch.int32, device=k.device)
        store_kv(k, v, self.cache.k[layer], self.cache.v[layer], self.slots, lengths, self.cache.pages)
        window = self.windows.get(layer)
        if window is None:
            return causal_sdpa(q, k, v)
        at = torch.arange(n, device=k.device)
        return causal_sdpa(q, k, v, window_mask(at[:, None], at[None, :], window))


@dataclass(frozen=True)
class InvariantPrefill(PrefillAttention):
    """Prompts, or chunks of them from a later position (``start``), through the batch-invariant
    kernels (StaticKV.invariant), so a request's keys, values and first token do not depend on
    the prompts prefilled beside it, the width they are padded to or where its chunks end: the
    linear layers and norms are the decode step's invariant forms (fused.run_stack), and
    attention is the decode kernel's invariant plan over the cache in windows that fit its
    query tile (a window's queries see the keys up to their own position): each prompt token
    attends exactly as a decode row at its position would. (The library's whole-prompt
    attention kernels change a row's reduction with the padded width or the batch.)"""

    start: Tensor | None = None  # [N] int64: each row's first position (a later chunk's), else 0

    def decoder_stack(self, layers, final_norm, rotary, h: Tensor, positions: Tensor, taps: tuple[int, ...] = ()
                      ) -> tuple[Tensor, Tensor | None]:
        n, w = positions.shape
        attn = layers[0].self_attn
        chunk = max(1, INVARIANT_QUERY_ROWS // (attn.num_heads // attn.num_kv_heads))  # tokens a window
        ends = torch.arange(chunk, w + chunk, chunk, device=h.device).clamp(max=w)  # each window's last position + 1
        kv_lens = ends.to(torch.int32)[:, None].expand(-1, n)  # [windows, N], once for every layer
        if self.start is not None:  # a later chunk's windows also see the keys cached before it
            kv_lens = kv_lens + self.start.to(torch.int32)[None, :]
        kv_lens = kv_lens.contiguous()
        return run_stack(layers, final_norm, rotary, h, positions.contiguous(), self.cache, self.slots, kv_lens[-1],
                         True, taps, attention=functools.partial(self._attend, kv_lens, chunk))

    def _attend(self, kv_lens: Tensor, chunk: int, q: Tensor, layer: int) -> Tensor:
        """q [N, Hq, W, D] over the W keys just stored -> [N, Hq, W, D], ``chunk`` tokens a
        window, window i's keys up to kv_lens[i]. Whole windows go as rows of one launch (a
        window of a prompt is a row: its slot, its length), as many as keep the launch's
        partial outputs within PARTIALS_BYTES: a long prompt's hundreds of windows take a few
        launches a layer, not one each. Every program computes what it would alone."""
        n, hq, w, d = q.shape
        out = torch.empty(n, w, hq, d, dtype=q.dtype, device=q.device).transpose(1, 2)
        k, v, splits = self.cache.k[layer], self.cache.v[layer], self.cache.splits(n)
        whole = w // chunk
        per_row = k.shape[1] * triton.next_power_of_2(splits.count) * (splits.rows or chunk) * d * 4
        per_launch = max(1, PARTIALS_BYTES // (per_row * n))  # windows a launch
        for first in range(0, whole, per_launch):
            m = min(whole, first + per_launch) - first
            span = slice(first * chunk, (first + m) * chunk)
            rows = q[:, :, span].reshape(n, hq, m, chunk, d).permute(2, 0, 1, 3, 4).reshape(m * n, hq, chunk, d)
            done = attend(rows, k, v, self.slots.repeat(m), kv_lens[first : first + m].reshape(-1), True,
                          self.cache.splits(m * n), pages=self.cache.pages)  # its programs for m * n rows
            out[:, :, span] = done.reshape(m, n, hq, chunk, d).permute(1, 2, 0, 3, 4).reshape(n, hq, m * chunk, d)
        if w % chunk:  # the last window, shorter
            tail = slice(whole * chunk, w)
            attend(q[:, :, tail], k, v, self.slots, kv_lens[whole], True, splits, out=out[:, :, tail],
                   tickets=self.cache.tickets, pages=self.cache.pages)
        return out


def causal_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """PyTorch's attention over whole prompts (q [N, Hq, T, D], k/v [N, Hkv, S, D]), the kv
    heads repeated for the query groups. Not cuDNN's kernel: it builds a plan per new shape on
    the request path (15 ms a call for a batch of 16 short prompts on an H200)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    with sdpa_kernel(PREFILL_SDPA):
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@dataclass
class Slot:
    """A request's handle on a drafter cache: its slot and how many positions each layer holds."""

    index: int
    filled: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Rows:
    """A batch's handle on drafter caches: device tensors, so graph replays read new values."""

    slots: Tensor  # [N] int64
    start: Tensor  # [N] int64, position of each row's first new token
    # [N] int64: start + the width of the one forward these rows serve, where the caller has it on
    # the device already (a chain's next positions); else computed once a forward (a launch)
    end: Tensor | None = None

    def keys_after(self, width: int) -> Tensor:
        """Each row's key count [N] after a forward of ``width`` new keys: ``end`` where the caller
        gave it (its promise that it is start + width: a device tensor cannot be checked without a
        wait), else start + width (a launch)."""
        return self.start + width if self.end is None else self.end


class RowsAttention:
    """Attention for Rows: each row's W new tokens at positions start .. start + W - 1.
    ``tapped``: see run_stack (the verify step starts the drafter's context update there).
    ``windows``: a drafter's sliding layers (sliding.py); the others attend as ``causal`` says."""

    def __init__(self, cache: StaticKV, rows: Rows, causal: bool, tapped: Callable[[Tensor], None] | None = None,
                 windows: dict[int, Window] | None = None):
        self.cache, self.rows, self.causal, self.tapped = cache, rows, causal, tapped
        self.windows = windows or {}
        self._lengths: dict[int, Tensor] = {}  # W -> kv_len, computed once per forward

    def kv_len(self, width: int) -> Tensor:
        """Each row's keys after a forward of ``width`` new ones (Rows.keys_after), once a forward."""
        if width not in self._lengths:
            self._lengths[width] = self.rows.keys_after(width)
        return self._lengths[width]

    def _long(self, width: int, heads: int) -> bool:
        """Causal query rows (width x query heads per kv head) too many for one tile: a later
        prompt chunk's drafter entries, which attend in windows (_in_windows)."""
        return self.causal and width * (heads // self.cache.kv_heads) > LONG_WINDOW

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        kv_len = self.kv_len(q.shape[2])
        long = self._long(q.shape[2], q.shape[1])
        if layer not in self.windows and not long:
            return self.cache.attention(self.rows.slots, kv_len, self.causal)(layer, q, k, v)
        store_kv(k, v, self.cache.k[layer], self.cache.v[layer], self.rows.slots, kv_len, self.cache.pages)
        if long:
            return self._in_windows(layer, q, kv_len)
        return attend_window(q, self.cache.k[layer], self.cache.v[layer], self.rows.slots, kv_len,
                             self.windows[layer], pages=self.cache.pages)

    def _in_windows(self, layer: int, q: Tensor, kv_len: Tensor) -> Tensor:
        """Causal queries [N, Hq, W, D] too many for one tile (a later prompt chunk's drafter
        entries), over their keys already stored: LONG_WINDOW query rows a launch, each window's
        queries seeing the keys up to its last position."""
        n, hq, w, d = q.shape
        step = max(1, LONG_WINDOW // (hq // self.cache.kv_heads))
        out = torch.empty(n, w, hq, d, dtype=q.dtype, device=q.device).transpose(1, 2)
        k, v, slots, window = self.cache.k[layer], self.cache.v[layer], self.rows.slots, self.windows.get(layer)
        for a in range(0, w, step):
            b = min(w, a + step)
            lens = kv_len - (w - b)
            if window is None:
                attend(q[:, :, a:b], k, v, slots, lens, True, self.cache.splits(n), out=out[:, :, a:b],
                       tickets=self.cache.tickets, pages=self.cache.pages)
            else:
                attend_window(q[:, :, a:b], k, v, slots, lens, window, out=out[:, :, a:b], pages=self.cache.pages)
        return out

    def decoder_stack(self, layers, final_norm, rotary, h: Tensor, positions: Tensor, taps: tuple[int, ...] = ()
                      ) -> tuple[Tensor, Tensor | None]:
        """Run whole decoder stacks with fused kernels (see fused.py) instead of layer by layer."""
        return run_stack(layers, final_norm, rotary, h, positions, self.cache, self.rows.slots,
                         self.kv_len(positions.shape[1]), self.causal, taps, self.tapped, self.windows)

    def decoder_layer(self, layer, residual: Tensor, x: Tensor, positions: Tensor, rotary, index: int,
                      final_norm) -> tuple[Tensor, Tensor]:
        """One decoder-shaped layer (an EAGLE-3 head) from its residual [N, W, H] and its normed
        input x [N, W, In], keys into layer ``index`` of the cache, then ``final_norm`` over its
        output -> (output, final_norm(output)) [N, W, H] each, in fused kernels (fused.py)."""
        n, w = positions.shape
        kv_len = self.kv_len(w)
        long = self._long(w, layer.self_attn.num_heads)
        h, mlp = layer_body(layer, residual.reshape(n * w, -1), x.reshape(n * w, -1), positions, rotary,
                            self.cache, index, self.rows.slots, kv_len, self.causal, self.windows.get(index),
                            attention=(lambda q, i: self._in_windows(i, q, kv_len)) if long else None)
        out, normed = add_norm(mlp, h, final_norm.weight, final_norm.eps)
        return out.view(n, w, -1), normed.view(n, w, -1)

    norm = staticmethod(rms_norm)
    normed_beside = staticmethod(normed_beside)


class StaticStore:
    """The KVStore the cuda backend lends to drafters that own a cache. Its caches are made on
    the first write, when the drafter's geometry is known (before any graph is captured); a
    handle's slot is taken at ``new()``, so the buffers can name it before anything is stored.
    ``share`` pages them with the target's table: a request's drafter entries then lie at its
    target row's pages (positions alike), so the handles take the target's slots (``bound``)."""

    def __init__(self, num_slots: int, max_len: int, device: torch.device):
        self.num_slots, self.max_len, self.device = num_slots, max_len, device
        self.cache: StaticKV | None = None
        self.slots = SlotPool(num_slots, "drafter KV")
        self.pager: PageTable | None = None
        self._bound: int | None = None  # the target slot the next handle takes (paged)

    def share(self, pager: PageTable | None) -> None:
        """Page the caches (made later) with the target's table ``pager`` (None: static slots)."""
        if self.cache is not None:
            raise RuntimeError("StaticStore.share: the drafter's caches exist already")
        self.pager = pager

    @contextmanager
    def bound(self, slot: int):
        """Handles made inside take target slot ``slot`` (paged: the table's row is the target's)."""
        self._bound = slot
        try:
            yield
        finally:
            self._bound = None

    def _ensure(self, num_layers: int, k: Tensor) -> StaticKV:
        """The caches, made on the first write from its keys [..., Hkv, T, D]."""
        return self._make(num_layers, k.shape[-3], k.shape[-1], k.dtype)

    @contextmanager
    def prefills_apart(self):
        """StaticKV.prefills_apart for the caches, once made (the first write, a warm-up's)."""
        if self.cache is None:
            yield
            return
        with self.cache.prefills_apart():
            yield

    def _make(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> StaticKV:
        if self.cache is None:
            self.cache = StaticKV(num_layers, self.num_slots, kv_heads, self.max_len, head_dim, dtype, self.device,
                                  paged=self.pager)
        return self.cache

    def new(self, num_layers: int) -> Slot:
        if self.pager is None:
            return Slot(index=self.slots.allocate(), filled=[0] * num_layers)
        if self._bound is None:
            raise RuntimeError("a paged drafter cache's handle is made at admission, bound to the target's slot")
        return Slot(index=self._bound, filled=[0] * num_layers)

    def append(self, cache: Slot, layer: int, k: Tensor, v: Tensor) -> None:
        store = self._ensure(len(cache.filled), k)
        if store.pager is not None:
            raise RuntimeError("StaticStore.append: an eager drafter's writes need static slots (paged KV is "
                               "for drafters that write through rows)")
        a, b = cache.filled[layer], cache.filled[layer] + k.shape[1]
        store.k[layer][cache.index, :, a:b] = k
        store.v[layer][cache.index, :, a:b] = v
        cache.filled[layer] = b

    def length(self, cache: Slot) -> int:
        return cache.filled[0]

    def truncate(self, cache: Slot, length: int) -> None:
        cache.filled = [min(f, length) for f in cache.filled]

    def release(self, cache: Slot) -> None:
        if cache.index >= 0 and self.pager is None:  # a paged handle's slot is the target's
            self.slots.release(cache.index)
        cache.index = -1

    def write_projected(self, rows: Rows, layers, x: Tensor, positions: Tensor, rotary, fc=None, hidden_norm=None
                        ) -> None:
        """Every DecoderLayer's k/v projection of x [N, W, H] (of hidden_norm(fc(x)) when given;
        k-norm, RoPE at positions [N, W]) at the rows' positions start .. start + W - 1: two
        launches a layer, two more for fc and the norm (fused.py)."""
        a = layers[0].self_attn
        cache = self._make(len(layers), a.num_kv_heads, a.head_dim, x.dtype)
        project_kv_stack(layers, x, positions, rotary, cache, rows.slots, rows.keys_after(x.shape[1]), fc, hidden_norm)

    def prefill_attention(self, rows: Rows, num_layers: int, windows: dict[int, int] | None = None
                          ) -> Callable[[int, Tensor, Tensor, Tensor], Tensor]:
        """Attention for the rows' first entries (a batched prefill's): causal among each
        row's own new keys, which are stored at positions 0 .. T - 1 of its slot (a sliding
        layer's, layer -> window in ``windows``, within its window)."""
        sliding = layer_windows(windows, causal=True)

        def attention(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return self._ensure(num_layers, k).prefill_attention(rows.slots, sliding)(layer, q, k, v)
        return attention

    def at(self, rows: Rows, start: Tensor, end: Tensor | None = None) -> Rows:
        """The same rows with their new keys going at ``start`` [N] (a chain's later steps);
        ``end`` [N]: start + the forward's width, where the caller has it (Rows.end)."""
        return Rows(rows.slots, start, end)

    def attention(self, caches: Rows | list[Slot], causal: bool, persist: bool, windows: dict[int, int] | None = None,
                  anchor: Tensor | None = None, block_causal: bool = False, per_query: bool = False
                  ) -> RowsAttention | SlotAttention:
        """New keys are always stored at their positions; ``persist`` needs nothing more here,
        since a row's length, not the cache, decides what later queries see. ``caches`` as a
        list of ``new()`` handles (an eager drafter's): each row's new keys go at its handle's
        end, which ``persist`` then moves past them. ``windows`` (layer -> sliding window) and
        the rest as the reference backend's store takes them (sliding.layer_windows), an
        ``anchor`` per row [N]."""
        sliding = layer_windows(windows, causal, anchor, block_causal, per_query)
        if isinstance(caches, list):
            if self.pager is not None:
                raise RuntimeError("an eager drafter's handles need static slots (paged KV is for drafters "
                                   "that write through rows)")
            return SlotAttention(self, caches, causal, persist, sliding)
        return RowsAttention(self.cache, caches, causal, windows=sliding)


@dataclass(frozen=True)
class SlotAttention:
    """Eager attention over per-request handles: append semantics on the static caches."""

    store: StaticStore
    caches: list[Slot]
    causal: bool
    persist: bool
    windows: dict[int, Window] = field(default_factory=dict)  # a drafter's sliding layers (sliding.py)

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        cache = self.store._ensure(len(self.caches[0].filled), k)
        dev, w = k.device, k.shape[2]
        slots = torch.tensor([s.index for s in self.caches], device=dev)
        start = torch.tensor([s.filled[layer] for s in self.caches], device=dev)
        window = self.windows.get(layer)
        if window is not None and w * (q.shape[1] // k.shape[1]) <= LONG_WINDOW:
            store_kv(k, v, cache.k[layer], cache.v[layer], slots, start + w, cache.pages)
            out = attend_window(q, cache.k[layer], cache.v[layer], slots, start + w, window, pages=cache.pages)
        elif w * (q.shape[1] // k.shape[1]) <= LONG_WINDOW:
            out = cache.attention(slots, start + w, self.causal)(layer, q, k, v)
        else:
            out = self._long(cache, layer, q, k, v, slots, start)
        if self.persist:
            for s in self.caches:
                s.filled[layer] += w
        return out

    def _long(self, cache: StaticKV, layer: int, q: Tensor, k: Tensor, v: Tensor, slots: Tensor, start: Tensor
              ) -> Tensor:
        """A long window (a prompt's drafter entries, at prefill): the decode kernel keeps a
        row's whole window in one tile, so these go through PyTorch's attention, row by row."""
        w = k.shape[2]
        store_kv(k, v, cache.k[layer], cache.v[layer], slots, start + w, cache.pages)
        out = []
        for i, (slot, first) in enumerate(zip(slots.tolist(), start.tolist())):
            keys, values = cache.k[layer][slot, :, : first + w], cache.v[layer][slot, :, : first + w]  # [Hkv, S, D]
            mask = None
            if self.causal:
                own = first + torch.arange(w, device=k.device)[:, None]  # [W, 1] each query's position
                mask = torch.arange(first + w, device=k.device)[None, :] <= own  # [W, S]
            if mask is None:
                mask = torch.ones(w, first + w, dtype=torch.bool, device=k.device)
            if layer in self.windows:
                own = first + torch.arange(w, device=k.device)[:, None]  # [W, 1]
                keys_at = torch.arange(first + w, device=k.device)[None, :]  # [1, S]
                mask = mask & window_mask(own, keys_at, self.windows[layer], i)
            out.append(causal_sdpa(q[i : i + 1], keys[None], values[None], mask))
        return torch.cat(out)


@dataclass(frozen=True)
class FrozenTargetKV:
    """TargetKV over the target's static cache: a row's verified keys are the first ``start``
    positions of its slot (what lies past them is a previous round's leftovers)."""

    cache: StaticKV
    slots: Tensor  # [N]
    start: Tensor  # [N] int64, each row's verified length

    def read(self, layer: int, q: Tensor) -> Tensor:
        return attend(q, self.cache.k[layer], self.cache.v[layer], self.slots, self.start, False,
                      self.cache.splits(self.slots.shape[0]), tickets=self.cache.tickets, pages=self.cache.pages)

    def query_layer(self, layer, residual: Tensor, x: Tensor, positions: Tensor, rotary, kv_layer: int,
                    final_norm) -> tuple[Tensor, Tensor]:
        """A query-only decoder layer (frozen-KV MTP) from its residual [N, W, H] and normed input
        x [N, W, H], reading target layer ``kv_layer``, then ``final_norm`` over its output ->
        (output, final_norm(output)) [N, W, H] each, in fused kernels (fused.py)."""
        n, w = positions.shape
        h, mlp = query_layer_body(layer, residual.reshape(n * w, -1), x.reshape(n * w, -1), positions, rotary,
                                  self.cache, kv_layer, self.slots, self.start)
        out, normed = add_norm(mlp, h, final_norm.weight, final_norm.eps)
        return out.view(n, w, -1), normed.view(n, w, -1)

    @staticmethod
    def project_norm(x: Tensor, projection, norm_module) -> tuple[Tensor, Tensor]:
        """(h, norm_module(h)) [..., N] each, for h = projection(x) (a bias-free Linear) of x [..., K]."""
        flat = x.reshape(-1, x.shape[-1])
        h, normed = linear_norm(flat, projection.weight, norm_module.weight, norm_module.eps)
        return h.view(*x.shape[:-1], -1), normed.view(*x.shape[:-1], -1)

    norm = staticmethod(rms_norm)
    embed_beside = staticmethod(embed_beside)
