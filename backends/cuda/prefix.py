"""Prefix caching on the cuda backend: the core PrefixCache's blocks (hash chains, pins, LRU
eviction) with their contents in a device store of their own.

A block's payload is its place in the store, which keeps, for a block of positions: the
target's keys and values at every layer; the drafter's, when it keeps a cache (DFlash's
context, EAGLE-3's layer), whose entries at a position depend only on the tokens and
features there; and, for drafters whose extension reads the features before it
(Drafter.extends_from_features: EAGLE-3), the target's tapped features at the block's last
position (what a chunk after the cached ones extends from). A hit copies
them into the request's slots, one gather a layer, and the rest of the prompt is prefilled as
a later chunk (CudaBackend.chunked_prefill): the invariant prefill computes each position as
it would whole, so output is the same with the cache or without. A prompt's full blocks (but
for its last token, whose drafter entry waits for the first drawn token) are copied out once
its prefill is done. Copies run in stream order with the forwards, so a block evicted and
given to another is read by every copy-in before it is written again.
"""

from __future__ import annotations

from dataclasses import dataclass

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

COPY_BYTES = 64 << 20  # a block copy's temporaries at most (a long prefix moves in a few copies)


# a prefill's tables (PrefillBuffers): a saved block's row, and a staged feature's
SAVE_COLS = 7  # its block, its place in the target's cache (slot or page, first position), in the drafter's, and
# where its last position's features wait (slot, block) to be kept with it (a drafter that reads them)
STAGE_COLS = 3  # where in ``staged`` (slot x blocks a slot + block), the chunk's row, the column in it
COPY_PROGRAMS = 16  # a copy's programs along its entries: a table's count is read on the device


@triton.jit
def _copy_kernel(src, dst, table, count, stride_table, ROWS_ALL, HEADS, LAYERS, s_two, s_layer, s_place, s_head, s_pos,
                 d_block, ID: tl.constexpr, PLACE: tl.constexpr, FIRST: tl.constexpr, SIZE: tl.constexpr,
                 ROWS: tl.constexpr, CHUNK: tl.constexpr, PROGRAMS: tl.constexpr):
    """Entries e < count[0] of ``table`` [entries, columns], program (p, r) those e = p mod
    PROGRAMS, rows r * ROWS ..: row j = (keys or values, layer, head) is SIZE contiguous elements
    at (table[e, PLACE], table[e, FIRST]) = (slot or page, first position) of src [2, layers,
    places, Hkv, positions, D], copied to row j of block table[e, ID] of dst [blocks, ...]. The
    count is the device's: a graph captured once copies what each prefill's table names."""
    j = tl.program_id(1).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    head, pair = j % HEADS, j // HEADS
    rows = (pair // LAYERS) * s_two + (pair % LAYERS) * s_layer + head * s_head
    for e in range(tl.program_id(0), tl.load(count), PROGRAMS):
        entry = table + e * stride_table
        at = rows + tl.load(entry + PLACE) * s_place + tl.load(entry + FIRST) * s_pos
        to = tl.load(entry + ID) * d_block + j * SIZE
        for c in range(0, SIZE, CHUNK):
            k = c + tl.arange(0, CHUNK)
            live = (j < ROWS_ALL)[:, None] & (k < SIZE)[None, :]
            tl.store(dst + to[:, None] + k[None, :], tl.load(src + at[:, None] + k[None, :], mask=live), mask=live)


def copy_rows(src: Tensor, dst: Tensor, table: Tensor, count: Tensor, columns: tuple[int, int, int],
              shape: tuple[int, int, int], strides: tuple[int, ...], size: int) -> None:
    """One launch: for each of the first count[0] entries of ``table``, columns (block, place,
    first), ``shape`` = (2, layers, heads) rows of ``size`` elements from src at ``strides`` =
    (two, layer, place, head, position) into that block of ``dst`` (a block: rows x size, contiguous)."""
    two, layers, heads = shape
    if src.dtype != dst.dtype or not dst.is_contiguous() or dst[0].numel() != two * layers * heads * size:
        raise ValueError(f"copy_rows: {tuple(src.shape)} {src.dtype} rows of {size} into {tuple(dst.shape)} {dst.dtype}")
    rows = two * layers * heads
    # GPU: few rows a program (a program's tile stays small); the interpreter, which pays per tile op, all at once
    per = triton.next_power_of_2(rows) if interpreted() else triton.next_power_of_2(triton.cdiv(rows, 64))
    chunk = triton.next_power_of_2(size) if interpreted() else min(triton.next_power_of_2(size), max(64, 4096 // per))
    programs = 1 if interpreted() else COPY_PROGRAMS
    ident, place, first = columns
    _copy_kernel[(programs, triton.cdiv(rows, per))](
        src, dst, table, count, table.stride(0), rows, heads, layers, *strides, dst.stride(0),
        ID=ident, PLACE=place, FIRST=first, SIZE=size, ROWS=per, CHUNK=chunk, PROGRAMS=programs)


@dataclass(frozen=True)
class BlockPool:
    """Keys and values of ``capacity`` blocks, every layer's: [capacity, 2, layers, Hkv, block, D]."""

    blocks: Tensor

    @staticmethod
    def like(cache: StaticKV, capacity: int, block: int) -> "BlockPool":
        two, layers, _, heads, _, dim = cache.data.shape
        return BlockPool(torch.zeros(capacity, two, layers, heads, block, dim, dtype=cache.data.dtype,
                                     device=cache.data.device))

    @property
    def capacity(self) -> int:
        return self.blocks.shape[0]

    def _groups(self, ids: Tensor) -> list[tuple[int, Tensor]]:
        """(first block, ids) in groups whose copies' temporaries stay within COPY_BYTES."""
        step = max(1, COPY_BYTES // (self.blocks[0].numel() * self.blocks.element_size()))
        return [(a, ids[a : a + step]) for a in range(0, ids.shape[0], step)]

    def load(self, cache: StaticKV, slot: int, ids: Tensor) -> None:
        """Blocks ``ids`` [nb] into positions 0 .. nb * block - 1 of ``slot``, every layer at once
        (a paged cache's pages are blocks: each goes to the slot's page of its place)."""
        block = self.blocks.shape[4]
        for a, group in self._groups(ids):
            if cache.pager is not None:
                pages = self._pages(cache, slot, a, group.shape[0])
                cache.data[:, :, pages] = self.blocks[group].permute(1, 2, 0, 3, 4, 5)  # [2, layers, n, Hkv, block, D]
                continue
            kv = self.blocks[group].permute(1, 2, 3, 0, 4, 5)  # [2, layers, Hkv, n, block, D]
            cache.data[:, :, slot, :, a * block : (a + group.shape[0]) * block] = kv.flatten(3, 4)

    def save(self, cache: StaticKV, table: Tensor, count: Tensor, place: int) -> None:
        """Blocks of ``cache`` into the pool, in one launch: entry e < count[0] of ``table``
        [entries, SAVE_COLS] names the block (column 0) and its place, columns ``place`` and
        ``place`` + 1: (page, 0) in a paged cache, (slot, first position) in a static one."""
        _, _, _, heads, _, dim = cache.data.shape
        if cache.data.stride(4) != dim or cache.data.stride(5) != 1 or not self.blocks.is_contiguous():
            raise ValueError("BlockPool.save: a cache whose positions' keys are not contiguous")
        copy_rows(cache.data, self.blocks, table, count, (0, place, place + 1), tuple(cache.data.shape[:2]) + (heads,),
                  cache.data.stride()[:5], self.blocks.shape[4] * dim)

    def places(self, cache: StaticKV, slot: int, first: int, count: int) -> list[tuple[int, int]]:
        """Where ``save`` reads a slot's blocks first .. first + count - 1: (page, 0) each, or (slot, position)."""
        block = self.blocks.shape[4]
        if cache.pager is not None:
            if cache.pager.size != block:
                raise ValueError(f"prefix blocks of {block} tokens over KV pages of {cache.pager.size}")
            return [(page, 0) for page in cache.pager.of(slot, first, count)]
        return [(slot, (first + j) * block) for j in range(count)]

    def _pages(self, cache: StaticKV, slot: int, first: int, count: int) -> Tensor:
        """A paged cache's pages of ``slot`` first .. first + count - 1, as a device index."""
        pages = [page for page, _ in self.places(cache, slot, first, count)]
        return cache.pager.put(torch.tensor(pages))  # in stream order, no wait


class DevicePrefix:
    """The cuda backend's prefix cache: ``index`` (core's, which /spec and the metrics read)
    over a device store of ``capacity`` blocks."""

    def __init__(self, block: int, capacity: int, target: StaticKV, store: StaticStore, ring: FeatureRing | None,
                 staging: "Staging"):
        self.index = PrefixCache(block, capacity, evicted=self._evicted)
        self.block, self.store, self.ring, self.target_cache = block, store, ring, target
        self.put = staging.put  # host values in stream order, no wait
        self.spare = list(range(capacity, -1, -1))  # one place more than blocks: an insert that evicts has one
        self.target = BlockPool.like(target, capacity + 1, block)
        self.drafter: BlockPool | None = None  # made once the drafter's caches exist (ready)
        if ring is not None:
            feats = ring.data.shape[2]
            self.last = torch.zeros(capacity + 1, feats, dtype=ring.data.dtype, device=ring.data.device)
            # [slots + 1, blocks a slot holds, F]: a prompt's chunks' features at its blocks' last positions
            self.staged = torch.zeros(target.scratch + 1, -(-target.max_len // block), feats, dtype=ring.data.dtype,
                                      device=ring.data.device)

    def ready(self) -> None:
        """Make the drafter's block store once its caches exist (start-up calls this after its
        warm-up prefills; else the first save does)."""
        if self.drafter is None and self.store.cache is not None:
            self.drafter = BlockPool.like(self.store.cache, self.target.capacity, self.block)

    def _evicted(self, block: Block) -> None:
        self.spare.append(block.payload)

    def restore(self, req: Request, draft_slot: int) -> int:
        """Pin the cached blocks ``req``'s prompt starts with (within all but its last token)
        and copy them into its slots -> the tokens they cover."""
        req.prefix_blocks = self.index.lookup(req.prefill_ids, req.prefill_len - 1)
        if not req.prefix_blocks:
            return 0
        ids = self.put(torch.tensor([b.payload for b in req.prefix_blocks]))
        self.target.load(self.target_cache, req.kv, ids)
        if self.drafter is not None:
            self.drafter.load(self.store.cache, draft_slot, ids)
        cached = len(req.prefix_blocks) * self.block
        if self.ring is not None:  # the features the next chunk's drafter entries extend from
            at = self.put(torch.tensor([req.kv, cached - 1]))
            self.ring.write(at[:1], at[1:], self.last[ids[-1:]][:, None])
        return cached

    def stages(self, slots: list[int], starts: list[int], ends: list[int]) -> np.ndarray:
        """Where a prefill's features at the last positions of the blocks its chunks cover (row i
        from position starts[i]) wait, by slot, until the prompt is saved -> [n, STAGE_COLS]
        for ``copy`` (none without a drafter that reads them)."""
        if self.ring is None:
            return np.zeros((0, STAGE_COLS), dtype=np.int64)
        blocks = self.staged.shape[1]
        return np.array([(slot * blocks + p // self.block, i, p - start)
                         for i, (slot, start, end) in enumerate(zip(slots, starts, ends))
                         for p in range((start // self.block + 1) * self.block - 1, end, self.block)],
                        dtype=np.int64).reshape(-1, STAGE_COLS)

    def saves(self, prompts: list[tuple[Request, int]]) -> np.ndarray:
        """Cache each prompt's full blocks past those it found (pinned for it until it ends):
        all but the last token's positions, into the index now -> [n, SAVE_COLS] for ``copy``,
        which copies them out of the prompts' slots at the end of their prefill's forward.
        ``prompts``: (request, its drafter slot)."""
        rows = []
        for req, slot in prompts:
            have, made = self._insert(req)
            if made:  # the drafter's caches page with the target's table, so its slot's places read alike
                ours = self.target.places(self.target_cache, req.kv, have, len(made))
                theirs = ours if slot == self.target_cache.scratch else \
                    self.target.places(self.target_cache, slot, have, len(made))  # (the scratch slot: no drafter cache)
                rows += [(b.payload, *t, *d, req.kv, have + j) for j, (b, t, d) in enumerate(zip(made, ours, theirs))]
        return np.array(rows, dtype=np.int64).reshape(-1, SAVE_COLS)

    def copy(self, saves: Tensor, stages: Tensor, counts: Tensor, features: Tensor | None) -> None:
        """A prefill's tables on the device (``counts`` [2]: the saves', the stages'), after its
        forward: its features staged, then the blocks saved (the target's, the drafter's, their
        last features). Launched inside the prefill's graph: no host work a prompt."""
        self.ready()  # the drafter's caches are made by the first prefill's forward (start-up's warm-up on a GPU)
        if self.ring is not None and features is not None:
            feats, features = features.shape[-1], features.contiguous()
            copy_rows(features, self.staged.view(-1, feats), stages, counts[1:], (0, 1, 2), (1, 1, 1),
                      (0, 0, features.stride(0), 0, features.stride(1)), feats)
        self.target.save(self.target_cache, saves, counts, 1)
        if self.drafter is not None:
            self.drafter.save(self.store.cache, saves, counts, 3)
        if self.ring is not None:
            feats = self.last.shape[1]
            copy_rows(self.staged, self.last, saves, counts, (0, 5, 6), (1, 1, 1),
                      (0, 0, self.staged.stride(0), 0, self.staged.stride(1)), feats)

    def _insert(self, req: Request) -> tuple[int, list[Block]]:
        """The prompt's full blocks past those it found, into the index -> (blocks it had, the
        blocks made); they stay pinned for it."""
        size, have, ids = self.block, len(req.prefix_blocks), req.prefill_ids
        parent, made = req.prefix_blocks[-1] if have else None, []
        for j in range(have, (len(ids) - 1) // size):
            place = self.spare.pop()
            parent = self.index.insert(parent, tuple(ids[j * size : (j + 1) * size]), place)
            if parent is None:  # every block pinned, or the block cached already by another request
                self.spare.append(place)
                break
            made.append(parent)
        req.prefix_blocks = req.prefix_blocks + made
        return have, made

    def release(self, req: Request) -> None:
        self.index.release(req.prefix_blocks)
        req.prefix_blocks = []
