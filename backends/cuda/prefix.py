"""Prefix caching on the cuda backend: the core PrefixCache's blocks (hash chains, pins, LRU
eviction) whose payload is a page of the paged KV pool, where the prompt that first held the
block computed it. A hit maps the cached pages into the new request's table line (pages.py:
``share``), so requests that start alike hold the same physical pages; nothing is copied.

A page holds a block's positions in the target's cache and in the drafter's (they share the
table), whose entries there depend only on the tokens and target features at and before them,
so a cached block serves the drafter too. Two things are the request's own: an EAGLE-3 head's
entry at a block's last position reads the token after it, which the next prompt may not share,
and a later chunk rewrites it; so for drafters that extend from features
(Drafter.extends_from_features) the last cached block is copied into a page of the request's
own, and the features at it (what the chunk after it extends from) are kept by page, staged
while the prompt is prefilled and kept when its blocks are cached. A prompt's full blocks (but
for its last token, whose drafter entry waits for the first drawn token) are cached when its
last chunk is prefilled. The prompt's rest is prefilled as a later chunk (CudaBackend.
chunked_prefill): the invariant prefill computes each position as it would whole, so output is
the same with the cache or without. Cached pages no request holds are reclaimed, least recently
used first, when the pool runs short (PageTable.evict): the cache takes no memory of its own.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from draftline.core.prefix import Block, PrefixCache
from draftline.core.request import Request

from .buffers import FeatureRing
from .kv import StaticKV, StaticStore
from .matvec import interpreted
from .staging import Staging

# a prefill's tables (PrefillBuffers), for drafters that extend from features: a cached block's
# row (its page, where its last position's features wait: slot, block), and a staged feature's
SAVE_COLS = 3
STAGE_COLS = 3  # where in ``staged`` (slot x blocks a slot + block), the chunk's row, the column in it
COPY_PROGRAMS = 16  # a copy's programs along its entries: a table's count is read on the device


@triton.jit
def _copy_kernel(src, dst, table, count, stride_table, src_row, src_pos, dst_row, WIDTH, ID: tl.constexpr,
                 PLACE: tl.constexpr, FIRST: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
    """Entries e < count[0] of ``table`` [entries, columns], program p those e = p mod PROGRAMS:
    the WIDTH elements at src + table[e, PLACE] * src_row + table[e, FIRST] * src_pos go to row
    table[e, ID] of dst. The count is the device's: a graph captured once copies what each
    prefill's table names."""
    k = tl.arange(0, BLOCK)
    for e in range(tl.program_id(0), tl.load(count), PROGRAMS):
        entry = table + e * stride_table
        at = tl.load(entry + PLACE).to(tl.int64) * src_row + tl.load(entry + FIRST).to(tl.int64) * src_pos
        to = tl.load(entry + ID).to(tl.int64) * dst_row
        for c in range(0, WIDTH, BLOCK):
            live = c + k < WIDTH
            tl.store(dst + to + c + k, tl.load(src + at + c + k, mask=live), mask=live)


def copy_rows(src: Tensor, dst: Tensor, table: Tensor, count: Tensor, columns: tuple[int, int, int],
              strides: tuple[int, int]) -> None:
    """One launch: for each of the first count[0] entries of ``table``, columns (row of dst,
    place, first), a row of dst's width from src at place * strides[0] + first * strides[1]."""
    width = dst.shape[-1]
    if src.dtype != dst.dtype or not dst.is_contiguous():
        raise ValueError(f"copy_rows: {src.dtype} rows into {tuple(dst.shape)} {dst.dtype}")
    programs = 1 if interpreted() else COPY_PROGRAMS
    ident, place, first = columns
    _copy_kernel[(programs,)](src, dst, table, count, table.stride(0), *strides, dst.stride(0), width,
                              ID=ident, PLACE=place, FIRST=first, BLOCK=min(1024, triton.next_power_of_2(width)),
                              PROGRAMS=programs)


class DevicePrefix:
    """The cuda backend's prefix cache: ``index`` (core's, which /spec and the metrics read)
    over the pages of the target's paged cache (and the drafter's, which shares its table)."""

    def __init__(self, block: int, target: StaticKV, store: StaticStore, ring: FeatureRing | None,
                 staging: Staging):
        self.pager = target.pager
        if self.pager is None or self.pager.size != block:
            raise ValueError(f"prefix blocks of {block} tokens need a paged cache of {block}-token pages")
        self.index = PrefixCache(block, self.pager.num_pages, evicted=self._evicted)
        self.pager.evict = self._evict
        self.block, self.store, self.ring, self.target = block, store, ring, target
        self.put = staging.put  # host values in stream order, no wait
        if ring is not None:
            feats = ring.data.shape[2]
            self.last = torch.zeros(self.pager.num_pages + 1, feats, dtype=ring.data.dtype, device=ring.data.device)
            # [slots + 1, blocks a slot holds, F]: a prompt's chunks' features at its blocks' last positions
            self.staged = torch.zeros(target.scratch + 1, -(-target.max_len // block), feats, dtype=ring.data.dtype,
                                      device=ring.data.device)

    def _evicted(self, block: Block) -> None:
        self.pager.drop(block.payload)

    def _evict(self, pages: int) -> int:
        """Let go of up to ``pages`` cached blocks no request holds, least recently used first."""
        done = 0
        while done < pages and self.index.evict():
            done += 1
        return done

    def restore(self, req: Request) -> int:
        """Pin the cached blocks ``req``'s prompt starts with (within all but its last token) and
        map their pages into its table line (the last one copied into a page of its own where
        the drafter extends from features) -> the tokens they cover."""
        req.prefix_blocks = self.index.lookup(req.prefill_ids, req.prefill_len - 1)
        pages = [b.payload for b in req.prefix_blocks]
        if not pages:
            return 0
        cached = len(pages) * self.block
        if self.ring is None:
            self.pager.share(req.kv, pages)
            return cached
        self.pager.share(req.kv, pages[:-1])
        self.pager.reserve(req.kv, cached)  # a page of its own for the last block, which its next chunk rewrites
        self._copy_page(pages[-1], self.pager.of(req.kv, len(pages) - 1, 1)[0])
        at = self.put(torch.tensor([req.kv, cached - 1, pages[-1]]))  # the features its next chunk extends from
        self.ring.write(at[:1], at[1:2], self.last[at[2:]][:, None])
        return cached

    def _copy_page(self, source: int, dest: int) -> None:
        """A page's keys and values, every layer's, the target's and the drafter's, into another."""
        at = self.put(torch.tensor([source, dest]))
        for cache in (self.target, self.store.cache):
            if cache is not None:
                cache.data[:, :, at[1]] = cache.data[:, :, at[0]]

    def stages(self, slots: list[int], starts: list[int], ends: list[int]) -> np.ndarray:
        """Where a prefill's features at the last positions of the blocks its chunks cover (row i
        from position starts[i]) wait, by slot, until the prompt's blocks are cached -> [n,
        STAGE_COLS] for ``copy`` (none without a drafter that reads them)."""
        if self.ring is None:
            return np.zeros((0, STAGE_COLS), dtype=np.int64)
        blocks = self.staged.shape[1]
        return np.array([(slot * blocks + p // self.block, i, p - start)
                         for i, (slot, start, end) in enumerate(zip(slots, starts, ends))
                         for p in range((start // self.block + 1) * self.block - 1, end, self.block)],
                        dtype=np.int64).reshape(-1, STAGE_COLS)

    def saves(self, prompts: list[Request]) -> np.ndarray:
        """Cache each prompt's full blocks past those it found (pinned for it until it ends): all
        but the last token's positions, their pages held by the cache now -> [n, SAVE_COLS] for
        ``copy``, which keeps their last positions' features (drafters that read them)."""
        rows = []
        for req in prompts:
            have, made = self._insert(req)
            rows += [(b.payload, req.kv, have + j) for j, b in enumerate(made)]
        if self.ring is None:
            return np.zeros((0, SAVE_COLS), dtype=np.int64)
        return np.array(rows, dtype=np.int64).reshape(-1, SAVE_COLS)

    def copy(self, saves: Tensor, stages: Tensor, counts: Tensor, features: Tensor | None) -> None:
        """A prefill's tables on the device (``counts`` [2]: the saves', the stages'), after its
        forward: its features staged, then the cached blocks' last features kept by page.
        Launched inside the prefill's graph: no host work a prompt."""
        if self.ring is None or features is None:
            return
        feats, features = features.shape[-1], features.contiguous()
        copy_rows(features, self.staged.view(-1, feats), stages, counts[1:], (0, 1, 2),
                  (features.stride(0), features.stride(1)))
        copy_rows(self.staged, self.last, saves, counts, (0, 1, 2), (self.staged.stride(0), self.staged.stride(1)))

    def _insert(self, req: Request) -> tuple[int, list[Block]]:
        """The prompt's full blocks past those it found, into the index with their pages ->
        (blocks it had, the blocks made); they stay pinned for it."""
        size, have, ids = self.block, len(req.prefix_blocks), req.prefill_ids
        parent, made = req.prefix_blocks[-1] if have else None, []
        for j in range(have, (len(ids) - 1) // size):
            page = self.pager.of(req.kv, j, 1)[0]
            parent = self.index.insert(parent, tuple(ids[j * size : (j + 1) * size]), page)
            if parent is None:  # every block pinned, or the block cached already by another request
                break
            self.pager.hold(page)
            made.append(parent)
        req.prefix_blocks = req.prefix_blocks + made
        return have, made

    def release(self, req: Request) -> None:
        self.index.release(req.prefix_blocks)
        req.prefix_blocks = []
