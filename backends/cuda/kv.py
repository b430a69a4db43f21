"""The cuda backend's KV caches and the stores it lends: static caches (one preallocated
tensor pair per layer, a slot per running request, or a pool of pages those slots take as they
grow), the drafter's store (keys at their absolute positions in the slot of the row), and the
target's cache read-only (a frozen-KV drafter's queries).

A request's keys live at their absolute positions, and what a query may see is decided by the
row's key count alone, so nothing is ever truncated: rejected drafts' keys sit past the count
until the next round writes over them. The last slot is scratch for the padding rows of a
graph bucket.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from draftline.core.models.ops import Forward, Ops

from .attention import Splits, invariant_split_plan, split_plan
from .pages import Pages, PageTable
from .sliding import layer_windows
from .views import BLOCK, CAUSAL, FROZEN, KVView, prefill_view


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

    def rows(self, layer: int, slots: Tensor, width: int) -> tuple[Tensor, Tensor]:
        """The rows' keys and values at positions 0 .. width - 1 of ``layer``, [N, Hkv, width, D]
        each (a copy: a prefill's, for PyTorch's attention)."""
        k, v = self.k[layer], self.v[layer]
        if self.pager is None:
            return k[slots, :, :width], v[slots, :, :width]
        size = self.pager.size
        pages = self.pages.table[slots, : -(-width // size)].long()  # [N, P]
        n, p = pages.shape
        def gather(t: Tensor) -> Tensor:  # [N, P, Hkv, size, D] -> [N, Hkv, P * size, D]
            return t[pages].permute(0, 2, 1, 3, 4).reshape(n, t.shape[1], p * size, -1)[:, :, :width]
        return gather(k), gather(v)

@dataclass
class Slot:
    """A request's handle on a drafter cache: its slot."""

    index: int


@dataclass(frozen=True)
class Rows:
    """A batch's handle on drafter caches (DraftRows.caches): device tensors, so graph replays
    read new values."""

    slots: Tensor  # [N] int64


class StaticStore:
    """The KVStore the cuda backend lends to drafters that own a cache: positional (a key at its
    absolute position in its row's slot). ``allocate`` makes the caches from the drafter's
    geometry before any graph is captured; a handle's slot is taken at ``new()``. ``share``
    pages them with the target's table: a request's drafter entries then lie at its target row's
    pages (positions alike), so the handles take the target's slots (``bound``)."""

    positional = True

    def __init__(self, num_slots: int, max_len: int, device: torch.device, ops: Ops):
        self.num_slots, self.max_len, self.device, self.ops = num_slots, max_len, device, ops
        self.cache: StaticKV | None = None
        self.slots = SlotPool(num_slots, "drafter KV")
        self.pager: PageTable | None = None
        self._bound: int | None = None  # the target slot the next handle takes (paged)

    def share(self, pager: PageTable | None) -> None:
        """Page the caches (made later) with the target's table ``pager`` (None: static slots)."""
        if self.cache is not None:
            raise RuntimeError("StaticStore.share: the drafter's caches exist already")
        self.pager = pager

    def allocate(self, model: nn.Module) -> None:
        """The caches for ``model``'s attention layers that keep keys (none: no caches)."""
        owners = [m for m in model.modules() if isinstance(getattr(m, "k_proj", None), nn.Linear)]
        if owners and self.cache is None:
            a = owners[0]
            self.cache = StaticKV(len(owners), self.num_slots, a.num_kv_heads, self.max_len, a.head_dim,
                                  a.k_proj.weight.dtype, self.device, paged=self.pager)

    @contextmanager
    def bound(self, slot: int):
        """Handles made inside take target slot ``slot`` (paged: the table's row is the target's)."""
        self._bound = slot
        try:
            yield
        finally:
            self._bound = None

    @contextmanager
    def prefills_apart(self):
        """StaticKV.prefills_apart for the caches, where there are any."""
        if self.cache is None:
            yield
            return
        with self.cache.prefills_apart():
            yield

    def new(self, num_layers: int) -> Slot:
        if self.pager is None:
            return Slot(self.slots.allocate())
        if self._bound is None:
            raise RuntimeError("a paged drafter cache's handle is made at admission, bound to the target's slot")
        return Slot(self._bound)

    def release(self, cache: Slot) -> None:
        if cache.index >= 0 and self.pager is None:  # a paged handle's slot is the target's
            self.slots.release(cache.index)
        cache.index = -1

    def forward(self, caches: Rows, positions: Tensor, causal: bool, persist: bool = True,
                windows: dict[int, int] | None = None, anchor: Tensor | None = None, block_causal: bool = False,
                per_query: bool = False, end: Tensor | None = None) -> Forward:
        """New keys are always stored at their positions; ``persist`` needs nothing more here,
        since a row's key count, not the cache, decides what later queries see."""
        kv_len = positions[:, -1] + 1 if end is None else end
        sliding = layer_windows(windows, causal, anchor, block_causal, per_query)
        return Forward(positions, KVView(self.cache, caches.slots, kv_len, CAUSAL if causal else BLOCK, sliding))

    def prefill(self, caches: Rows, positions: Tensor, windows: dict[int, int] | None = None) -> Forward:
        view = prefill_view(self.cache, caches.slots, positions.shape[1], 1, windows=layer_windows(windows, True))
        return Forward(positions, view)

    def truncate(self, cache: Slot, length: int) -> None:
        raise RuntimeError("a positional store keeps every key where it lies: nothing to truncate")


@dataclass(frozen=True)
class FrozenTargetKV:
    """TargetKV over the target's static cache: a row's verified keys are the first ``start``
    positions of its slot (what lies past them is a previous round's leftovers)."""

    cache: StaticKV
    slots: Tensor  # [N]
    start: Tensor  # [N] int64, each row's verified length

    def forward(self, positions: Tensor, layer: int) -> Forward:
        return Forward(positions, KVView(self.cache, self.slots, self.start, FROZEN, read_layer=layer))
