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

import torch
import triton
import triton.language as tl
from torch import Tensor


@dataclass(frozen=True)
class Pages:
    table: Tensor  # [slots + 1, pages a row] int32: a slot's i-th page's index in the cache tensor
    size: int  # positions a page

    @staticmethod
    def identity(num_slots: int, size: int, device: torch.device | str) -> "Pages":
        """A static cache's table: slot s's positions 0 .. size - 1 are page s."""
        return Pages(torch.arange(num_slots, dtype=torch.int32, device=device).view(-1, 1), size)

    @staticmethod
    def of(cache: Tensor, pages: "Pages | None") -> "Pages":
        """``pages``, or a fresh identity table over a static cache [slots, Hkv, max_len, D] (the
        callers outside the backend's caches: kernel tests and benches; it is made eagerly)."""
        return pages if pages is not None else Pages.identity(cache.shape[0], cache.shape[2], cache.device)

    def check(self, cache: Tensor) -> None:
        """The table's pages must lie in ``cache`` and its pages hold ``size`` positions."""
        if cache.shape[2] != self.size or self.table.dtype != torch.int32 or self.table.dim() != 2:
            raise ValueError(f"pages of {self.size} positions (an int32 table [slots, pages]) do not fit a cache "
                             f"{tuple(cache.shape)} of {cache.shape[2]}-position pages")


@triton.jit
def paged(table, ts, slot, pos, mask, PAGE: tl.constexpr, sc_page, sc_pos):
    """The offset in a cache tensor of position ``pos`` (scalar or vector, int64) of ``slot``'s
    row: its page's index times the page stride, plus its place in the page. The table is read
    only where ``mask`` holds (a masked position may lie past the row's pages)."""
    page = tl.load(table + slot * ts + pos // PAGE, mask=mask, other=0).to(tl.int64)
    return page * sc_page + (pos % PAGE) * sc_pos


def launch_args(pages: Pages) -> tuple[Tensor, int]:
    """The table and its row stride, as the kernels take them (PAGE=pages.size beside)."""
    return pages.table, pages.table.stride(0)
