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


@triton.jit
def _save_kernel(src, dst, where, ids, ROWS_ALL, HEADS, LAYERS, s_two, s_layer, s_place, s_head, s_pos, d_block,
                 SIZE: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr):
    """Program (block i, ROWS rows): row j = (keys or values, layer, head) of block i is SIZE
    contiguous elements (its positions' D each) at where[i] = (slot or page, first position) of
    src [2, layers, places, Hkv, positions, D], copied to dst [blocks, 2, layers, Hkv, block, D] at ids[i]."""
    i = tl.program_id(0)
    j = tl.program_id(1).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    head, pair = j % HEADS, j // HEADS
    place, first, block = tl.load(where + 2 * i), tl.load(where + 2 * i + 1), tl.load(ids + i)
    at = (pair // LAYERS) * s_two + (pair % LAYERS) * s_layer + place * s_place + head * s_head + first * s_pos
    to = block * d_block + j * SIZE
    for c in range(0, SIZE, CHUNK):
        e = c + tl.arange(0, CHUNK)
        live = (j < ROWS_ALL)[:, None] & (e < SIZE)[None, :]
        tl.store(dst + to[:, None] + e[None, :], tl.load(src + at[:, None] + e[None, :], mask=live), mask=live)


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

    def save(self, cache: StaticKV, where: Tensor, ids: Tensor) -> None:
        """Blocks of ``cache`` into blocks ``ids`` [nb]: ``where`` [nb, 2] is each one's place
        (page, 0) in a paged cache or (slot, first position) in a static one. One launch, where
        slicing, indexing and scattering the blocks took about six PyTorch calls a store, each
        paid on the host at every prompt's prefill."""
        two, layers, _, heads, _, dim = cache.data.shape
        rows, size = two * layers * heads, self.blocks.shape[4] * dim  # a block's rows of size contiguous elements
        if cache.data.stride(4) != dim or cache.data.stride(5) != 1 or not self.blocks.is_contiguous():
            raise ValueError("BlockPool.save: a cache whose positions' keys are not contiguous")
        # GPU: a program a (block, row); the interpreter, which pays per tile op, every row at once
        per, chunk = (1, min(triton.next_power_of_2(size), 1024)) if not interpreted() else \
            (triton.next_power_of_2(rows), triton.next_power_of_2(size))
        _save_kernel[(ids.shape[0], triton.cdiv(rows, per))](
            cache.data, self.blocks, where, ids, rows, heads, layers, *cache.data.stride()[:5],
            self.blocks.stride(0), SIZE=size, ROWS=per, CHUNK=chunk)

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
        self.put, self.put_many = staging.put, staging.put_many  # host values in stream order, no wait
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

    def stage(self, slots: list[int], starts: list[int], ends: list[int], features: Tensor) -> None:
        """A prefill's features [rows, width, F] at the last positions of the blocks its chunks
        cover (row i from position starts[i]), kept by slot until the prompt is saved."""
        if self.ring is None:
            return
        where = [(i, p - start, slot, p // self.block) for i, (slot, start, end) in enumerate(zip(slots, starts, ends))
                 for p in range((start // self.block + 1) * self.block - 1, end, self.block)]
        if where:
            at = self.put(torch.tensor(where).T)  # [4, n]: row, column, slot, block
            self.staged[at[2], at[3]] = features[at[0], at[1]].to(self.staged.dtype)

    def save(self, prompts: list[tuple[Request, int]]) -> None:
        """Cache each prompt's full blocks past those it found (pinned for it until it ends),
        copied out of its slots: all but the last token's positions. ``prompts``: (request, its
        drafter slot). Every prompt's blocks move in one copy a store."""
        saved = []  # (request, drafter slot, blocks it had, blocks made), in insertion order
        for req, slot in prompts:
            have, made = self._insert(req)
            if made:
                saved.append((req, slot, have, made))
        if not saved:
            return
        self.ready()
        pools = [(self.target, self.target_cache, [req.kv for req, *_ in saved])]  # (pool, cache, each prompt's slot)
        if self.drafter is not None:
            pools.append((self.drafter, self.store.cache, [slot for _, slot, *_ in saved]))
        payloads = np.array([b.payload for *_, made in saved for b in made], dtype=np.int64)
        places = [np.array([p for (_, _, have, made), slot in zip(saved, slots)
                            for p in pool.places(cache, slot, have, len(made))], dtype=np.int64)
                  for pool, cache, slots in pools]
        ids, *wheres = self.put_many(payloads, *places)
        for (pool, cache, _), where in zip(pools, wheres):
            pool.save(cache, where, ids)
        if self.ring is not None:
            rows = np.array([(req.kv, have + j) for req, _, have, made in saved for j in range(len(made))], dtype=np.int64)
            at = self.put(rows)
            self.last[ids] = self.staged[at[:, 0], at[:, 1]]

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
