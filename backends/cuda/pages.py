"""Where a row's cached keys lie: pages of a KV cache and the table that maps them.

A cache tensor is [pages, Hkv, size, D]: a page holds ``size`` consecutive positions of one
row. A row's slot names its line of the table [slots + 1, pages a row] (int32), whose entry i
is the page holding positions i * size .. (i + 1) * size - 1. Every kernel that reads or
writes cached keys (the store, attention, the sliding window, the q/k/v kernel) finds them
through it, so the same kernels serve a static cache, whose table is the identity (a slot's
one page is the page of its own number, ``size`` its whole length), and one whose pages come
from a shared pool (paged KV).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor


@dataclass(frozen=True)
class Pages:
    table: Tensor  # [slots + 1, pages a row] int32: a slot's i-th page's index in the cache tensor
    size: int  # positions a page
    identity: bool = False  # a static cache's table: the kernels address the slot directly, not reading it

    @staticmethod
    def identity_of(num_slots: int, size: int, device: torch.device | str) -> "Pages":
        """A static cache's table: slot s's positions 0 .. size - 1 are page s."""
        return Pages(torch.arange(num_slots, dtype=torch.int32, device=device).view(-1, 1), size, identity=True)

    @staticmethod
    def of(cache: Tensor, pages: "Pages | None") -> "Pages":
        """``pages``, or a fresh identity table over a static cache [slots, Hkv, max_len, D] (the
        callers outside the backend's caches: kernel tests and benches; it is made eagerly)."""
        return pages if pages is not None else Pages.identity_of(cache.shape[0], cache.shape[2], cache.device)


@triton.jit
def paged(table, ts, slot, pos, mask, PAGE: tl.constexpr, sc_page, sc_pos):
    """The offset in a cache tensor of position ``pos`` (scalar or vector, int64) of ``slot``'s
    row: its page's index times the page stride, plus its place in the page. The table is read
    only where ``mask`` holds (a masked position may lie past the row's pages). PAGE 0: a static
    cache, whose slot is its one page (the table is not read)."""
    if PAGE == 0:
        return slot * sc_page + pos * sc_pos
    page = tl.load(table + slot * ts + pos // PAGE, mask=mask, other=0).to(tl.int64)
    return page * sc_page + (pos % PAGE) * sc_pos


def launch_args(pages: Pages) -> tuple[Tensor, int]:
    """The table and its row stride, as the kernels take them (PAGE=page_size(pages) beside)."""
    return pages.table, pages.table.stride(0)


def page_size(pages: Pages) -> int:
    """The kernels' PAGE: the page size, or 0 for a static cache (each slot addressed directly:
    no table read, no division, as before pages)."""
    return 0 if pages.identity else pages.size


class PageTable:
    """A pool of ``num_pages`` pages of ``size`` positions handed to slots as their rows grow
    (paged KV): a slot's table line holds its pages in position order and, past them, the
    scratch page (index ``num_pages``), where whatever a kernel writes beyond a row's pages
    lands (a padded prefill's tail, the padding rows of a graph bucket) and nothing that is
    read as a key. A page may be held by several slots' lines and by the prefix cache (a
    cached block's page, shared by the requests whose prompts start with it: ``share``,
    ``hold``): it returns to the free pages when its last holder lets it go. When a reserve
    finds too few free pages, ``evict`` (the prefix cache's) lets go of cached pages no slot
    holds. ``put`` moves a host tensor to the device in stream order (the backend's), so a
    table line changes after every launch already queued has read it."""

    def __init__(self, num_slots: int, per_row: int, num_pages: int, size: int, device: torch.device, put=None):
        self.scratch, self.size, self.per_row, self.num_pages = num_pages, size, per_row, num_pages
        table = torch.full((num_slots + 1, per_row), num_pages, dtype=torch.int32, device=device)
        self.pages = Pages(table, size)
        self.owned: list[list[int]] = [[] for _ in range(num_slots + 1)]
        self.refs = [0] * num_pages  # each page's holders: slots' lines and the prefix cache
        self.free = list(range(num_pages - 1, -1, -1))  # lowest first
        self.put = put or (lambda host: host.to(device))
        self.evict: Callable[[int], int] | None = None  # frees up to n cached pages no slot holds -> how many
        self.pending: list[tuple[int, int]] = []  # (place in the flattened table, page) not yet on the device

    def reserve(self, slot: int, positions: int) -> None:
        """Pages for the slot's positions 0 .. positions - 1 (at most a row's worth), written to
        the device's table by the next ``flush``."""
        have = self.owned[slot]
        need = min(-(-positions // self.size), self.per_row)
        if need - len(have) > len(self.free) and self.evict is not None:
            self.evict(need - len(have) - len(self.free))
        if need - len(have) > len(self.free):
            raise PagesExhausted(f"{need - len(have)} more KV pages wanted, {len(self.free)} free; "
                                 "raise server.num_kv_blocks or lower server.max_batch_size")
        for _ in range(len(have), need):
            self._append(slot, self.free.pop())

    def share(self, slot: int, pages: list[int]) -> None:
        """The slot's line starts with ``pages`` (a cached prefix's), held with their other holders."""
        if self.owned[slot]:
            raise ValueError(f"slot {slot} holds pages already: a shared prefix comes first")
        for page in pages:
            self._append(slot, page)

    def _append(self, slot: int, page: int) -> None:
        self.refs[page] += 1
        self.pending.append((slot * self.per_row + len(self.owned[slot]), page))
        self.owned[slot].append(page)

    def hold(self, page: int) -> None:
        """One more holder for ``page`` (the prefix cache, caching the block it holds)."""
        self.refs[page] += 1

    def drop(self, page: int) -> None:
        """One holder fewer; a page no one holds is free."""
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.free.append(page)
        elif self.refs[page] < 0:
            raise RuntimeError(f"KV page {page} let go more often than it was held")

    def flush(self) -> None:
        """The pages reserved since the last flush into the device's table, in one copy."""
        if self.pending:
            moved = self.put(torch.tensor(self.pending, dtype=torch.int64))  # [n, 2]: place, page
            self.pages.table.view(-1)[moved[:, 0]] = moved[:, 1].to(torch.int32)
            self.pending = []

    def release(self, slot: int) -> None:
        self.flush()  # a page reserved and released before any launch: its entry is reset after it
        have = self.owned[slot]
        if have:
            self.pages.table[slot, : len(have)] = self.scratch
            for page in reversed(have):
                self.drop(page)
            self.owned[slot] = []

    def of(self, slot: int, first: int, count: int) -> list[int]:
        """The slot's pages first .. first + count - 1 (which must be its own)."""
        if first + count > len(self.owned[slot]):
            raise ValueError(f"slot {slot} holds {len(self.owned[slot])} pages, not {first + count}")
        return self.owned[slot][first : first + count]

    @property
    def in_use(self) -> int:
        """Pages some holder has (a slot's line or the prefix cache)."""
        return self.num_pages - len(self.free)


class PagesExhausted(RuntimeError):
    pass
