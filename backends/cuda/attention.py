"""Attention over the static KV cache: the new tokens' K/V are stored at their positions, then
each row's queries attend over its own cached length, split along the keys (flash-decoding).
How many keys a split takes is read on the device from the row's length (``Splits``), so a
short row uses few splits and a long one many, in the same graph.

Cache layout per layer: [pages, Hkv, page size, D], a row's pages found through its slot's line
of a table (pages.py); a static cache is its own pages ([slots, Hkv, max_len, D], a page a slot).
A row's W new tokens sit at positions kv_len - W .. kv_len - 1. With ``causal`` query t sees
keys up to its own position (verify); without, every key below kv_len (the DFlash block over
its context). Shapes are fixed by (rows, W, cache), so the launches are graph-safe; only
kv_len and slots, read on the device, vary between replays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import overlap
from .matvec import interpreted, summed, tile_dot
from .pages import Pages, launch_args, page_size, paged


@triton.jit
def _store_kernel(k_new, v_new, k_cache, v_cache, slots, kv_len, table, ts, W,
                  skn, skh, skt, svn, svh, svt, sc_page, sc_head, sc_pos,
                  D: tl.constexpr, PAGE: tl.constexpr, PDL: tl.constexpr):
    """One program per (row, new token, kv head): copy its k and v rows into the cache."""
    overlap.gate(PDL)
    pid, h = tl.program_id(0), tl.program_id(1)
    n, t = (pid // W).to(tl.int64), pid % W  # int64: a long prefill's rows x strides pass 2^31
    slot = tl.load(slots + n).to(tl.int64)
    pos = (tl.load(kv_len + n) - W + t).to(tl.int64)
    d = tl.arange(0, D)
    ok = d < tl.where(pos >= 0, D, 0)  # a position before the row's start has no page: nothing is stored
    dst = paged(table, ts, slot, pos, pos >= 0, PAGE, sc_page, sc_pos) + h * sc_head + d
    tl.store(k_cache + dst, tl.load(k_new + n * skn + h * skh + t * skt + d), mask=ok)
    tl.store(v_cache + dst, tl.load(v_new + n * svn + h * svh + t * svt + d), mask=ok)


@triton.jit
def _split_keys(length, count, least, BLOCK_N: tl.constexpr):
    """Keys per split of a row of ``length`` keys: the fewest that fit ``count`` splits, rounded
    up to whole key blocks, and at least ``least``."""
    return tl.maximum(tl.cdiv(tl.cdiv(length, count), BLOCK_N) * BLOCK_N, least)


@triton.jit
def _prefetch_split(k_cache, v_cache, slots, kv_len, table, ts, n, h, s, count, least, sc_page, sc_head, sc_pos,
                    num_slots, num_pages, max_len, BLOCK_N: tl.constexpr, KEYS: tl.constexpr, LINES: tl.constexpr,
                    D: tl.constexpr, PAGE: tl.constexpr):
    """Ask L2 for the first KEYS cached keys and values of split s (128-byte lines). Issued
    before the gate, while the kernel ahead still runs, so the length and slot read here may
    be stale: whatever memory held before a kernel ahead wrote it (a tensor just allocated).
    Nothing here is trusted afterwards (the program reads everything again), and the slot, key
    and page are clamped into the table and the cache, so a stale value only fetches useless
    lines of it: a prefetch of an address outside it faults like a load (an illegal memory
    access that ends the process)."""
    length = tl.load(kv_len + n)
    slot = tl.minimum(tl.maximum(tl.load(slots + n).to(tl.int64), 0), num_slots - 1)
    split = _split_keys(length, count, least, BLOCK_N)
    j = s * split + tl.arange(0, KEYS)
    j = tl.minimum(tl.maximum(tl.where(j < tl.minimum(s * split + split, length), j, 0), 0), max_len - 1).to(tl.int64)
    if PAGE == 0:  # a static cache: the slot is its page
        key = slot * sc_page + j * sc_pos
    else:
        page = tl.minimum(tl.maximum(tl.load(table + slot * ts + j // PAGE).to(tl.int64), 0), num_pages - 1)
        key = page * sc_page + (j % PAGE) * sc_pos
    at = (key + h * sc_head)[:, None] + \
        (tl.arange(0, LINES) * (D // LINES))[None, :]  # [KEYS, LINES]: a key's D elements are LINES lines
    _prefetch_l2(k_cache + at)
    _prefetch_l2(v_cache + at)


@triton.jit
def _prefetch_l2(ptrs):
    """prefetch.global.L2 of each address (the returned zeros only give the asm a result)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _attend_kernel(q, k_cache, v_cache, slots, kv_len, table, ts, o_part, lse_part, tickets, o, scale,
                   HQ, HKV, W, G, sc_page, sc_head, sc_pos, sq_n, sq_h, sq_t, so_n, so_h, so_t, count, least,
                   num_slots, num_pages, max_len, CAUSAL: tl.constexpr, SPLITS: tl.constexpr, MERGE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr,
                   PAGE: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr = False, LINES: tl.constexpr = 1,
                   SUMMED: tl.constexpr = False):
    """Program (row n, kv head h, first of P): the G*W query rows of h's query heads over the
    keys of splits s = first, first + P, ... of the row's live ones, [s*split, (s+1)*split) ∩ [0, kv_len),
    split from _split_keys; writes each split's normalized partial output and its log-sum-exp
    (-inf where the split saw no key). A split's sums do not depend on which program takes it,
    so P (Splits.programs) changes no bit. With MERGE the last of (n, h)'s programs to finish
    then merges the partials into o (no combine launch). With PREFETCH (under PDL) it first asks
    L2 for its first split's cached keys, so they arrive while the q/k/v kernel ahead runs."""
    pid, first = tl.program_id(0), tl.program_id(1)  # first: this program's first split
    n, h = (pid // HKV).to(tl.int64), pid % HKV  # int64: a long prefill's rows x strides pass 2^31
    if PREFETCH:
        _prefetch_split(k_cache, v_cache, slots, kv_len, table, ts, n, h, first, count, least, sc_page, sc_head,
                        sc_pos, num_slots, num_pages, max_len, BLOCK_N, 128, LINES, D, PAGE)
    overlap.gate(PDL)
    m = tl.arange(0, BLOCK_M)  # query row = g * W + t
    d = tl.arange(0, D)
    rows = G * W
    q_row = n * sq_n + (h * G + m // W) * sq_h + (m % W) * sq_t  # [BLOCK_M]
    q_tile = tl.load(q + q_row[:, None] + d[None, :], mask=m[:, None] < rows, other=0.0)
    length = tl.load(kv_len + n)
    own = length - W + m % W  # each query's own position
    slot = tl.load(slots + n).to(tl.int64)
    split = _split_keys(length, count, least, BLOCK_N)
    for s in range(first, tl.cdiv(length, split), tl.num_programs(1)):  # the row's live splits; none past them
        lo = s * split
        hi = tl.minimum(lo + split, length)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        for start in range(lo, hi, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            inside = j < hi
            key = paged(table, ts, slot, j.to(tl.int64), inside, PAGE, sc_page, sc_pos) + h * sc_head
            at = key[:, None] + d[None, :]
            k_tile = tl.load(k_cache + at, mask=inside[:, None], other=0.0)
            scores = tile_dot(q_tile, tl.trans(k_tile), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), PRECISION,
                              SUMMED) * scale  # [BLOCK_M, BLOCK_N] fp32
            visible = inside[None, :]
            if CAUSAL:
                visible = visible & (j[None, :] <= own[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v_tile = tl.load(v_cache + at, mask=inside[:, None], other=0.0)
            acc = acc * alpha[:, None] + tile_dot(p.to(v_tile.dtype), v_tile, tl.zeros((BLOCK_M, D), tl.float32),
                                                  PRECISION, SUMMED)
            m_i = m_new
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
        part = (pid * SPLITS + s) * BLOCK_M
        tl.store(o_part + (part + m[:, None]) * D + d[None, :], out.to(o_part.dtype.element_ty))
        tl.store(lse_part + part + m, lse)
    if MERGE:
        # The barrier puts every thread's stores above before this program's arrival (a release).
        tl.debug_barrier()
        if tl.atomic_add(tickets + pid, 1, sem="acq_rel", scope="gpu") == tl.num_programs(1) - 1:
            tl.store(tickets + pid, 0)  # the others have all arrived: ready for the next launch
            res = _merge(o_part, lse_part, pid * SPLITS, tl.cdiv(length, split), BLOCK_M, D)
            o_row = n * so_n + (h * G + m // W) * so_h + (m % W) * so_t  # [BLOCK_M]
            tl.store(o + o_row[:, None] + d[None, :], res.to(o.dtype.element_ty), mask=(m < rows)[:, None])


@triton.jit
def _merge(o_part, lse_part, first, splits, BLOCK_M: tl.constexpr, D: tl.constexpr):
    """A row's ``splits`` partial outputs merged by their log-sum-exps, read in split order
    (whichever program merges, the sum runs in the same order: replays are bit-identical) from
    L2 (.cg: this SM's L1 may hold lines of an earlier launch)."""
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    top = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for t in range(0, splits):
        part = (first + t) * BLOCK_M + m
        lse_t = tl.load(lse_part + part, cache_modifier=".cg")
        o_t = tl.load(o_part + part[:, None] * D + d[None, :], cache_modifier=".cg").to(tl.float32)
        new = tl.maximum(top, lse_t)
        safe = tl.where(new == float("-inf"), 0.0, new)
        a, b = tl.exp(top - safe), tl.exp(lse_t - safe)
        acc = acc * a[:, None] + o_t * b[:, None]
        total = total * a + b
        top = new
    return acc / tl.where(total > 0, total, 1.0)[:, None]


@triton.jit
def _combine_kernel(o_part, lse_part, kv_len, out, HQ, HKV, W, G, so_n, so_h, so_t, count, least,
                    SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                    PDL: tl.constexpr):
    """Program (row, kv head, query row m): merge the row's live splits by their log-sum-exps,
    all splits in one vectorized pass."""
    overlap.gate(PDL)
    pid, m = tl.program_id(0), tl.program_id(1)
    n, h = (pid // HKV).to(tl.int64), pid % HKV  # int64: a long prefill's rows x strides pass 2^31
    s = tl.arange(0, SPLITS)
    length = tl.load(kv_len + n)
    live = s < tl.cdiv(length, _split_keys(length, count, least, BLOCK_N))
    part = (pid * SPLITS + s) * BLOCK_M + m  # [SPLITS]
    lse = tl.load(lse_part + part, mask=live, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.where(live, tl.exp(lse - top), 0.0)
    total = tl.sum(weight, axis=0)
    d = tl.arange(0, D)
    o = tl.load(o_part + part[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
    res = tl.sum(weight[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out + n * so_n + (h * G + m // W) * so_h + (m % W) * so_t + d, res.to(out.dtype.element_ty))


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, kv_len: Tensor,
             pages: Pages | None = None) -> None:
    """k, v [N, Hkv, W, D] (any strides) -> cache rows at positions kv_len - W .. kv_len - 1
    (through ``pages``; without, the cache [slots, Hkv, max_len, D] is its own pages)."""
    pages = Pages.of(k_cache, pages)
    n, hkv, w, d = k.shape
    _store_kernel[(n * w, hkv)](k, v, k_cache, v_cache, slots, kv_len, *launch_args(pages), w, k.stride(0),
                                k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), k_cache.stride(0),
                                k_cache.stride(1), k_cache.stride(2), D=d, PAGE=page_size(pages),
                                **overlap.launch(release=False))


@dataclass(frozen=True)
class Splits:
    """How each row's keys split over attention programs: into at most ``count`` splits of at
    least ``least`` keys (a power of two), sized on the device from the row's length.
    ``programs`` (else ``count``) programs per (row, kv head) are launched, each taking every
    programs-th of the row's live splits (one with none does no work). With ``merge`` the last
    of them to finish, whichever it is, merges the row's splits itself (a ticket count says
    which is last) instead of a combine kernel over all of them."""

    count: int
    least: int
    merge: bool = False  # the last program of a (row, kv head) to finish merges them: no combine launch
    widest: int = 64  # keys per step inside a split, at most
    rows: int = 0  # query rows a program's tile holds whatever the window (0: sized by the call)
    programs: int = 0  # programs per (row, kv head), each taking every programs-th split (0: count)

    @property
    def launched(self) -> int:
        return self.programs or self.count

    @property
    def block(self) -> int:
        return min(self.widest, self.least)  # keys per step inside a split


def split_plan(max_len: int, rows: int = 1, kv_heads: int = 8) -> Splits:
    """The device's plan (device_split_plan); under the interpreter (CI on the CPU), one split
    over the whole cache in one step instead: it runs programs one after another and pays per
    tile op, not per element. The GPU tests hold the device's plan to the reference, and the
    kernel tests give explicit plans."""
    if interpreted():
        whole = triton.next_power_of_2(max_len)
        return Splits(1, whole, merge=True, widest=whole)
    return device_split_plan(max_len, rows, kv_heads)


INVARIANT_SPLIT = 256  # keys per split of the batch-invariant plan, at fixed offsets 0, 256, 512, ...
INVARIANT_MERGE_MOST = 16  # splits past which the invariant plan keeps a combine kernel
INVARIANT_QUERY_ROWS = 64  # query rows per (row, kv head) tile in that plan: G x W up to 64 (Qwen3-8B: 4 x 16)
INVARIANT_PROGRAMS = 1024  # attention programs a launch of that plan aims at, over its rows and kv heads


def invariant_split_plan(max_len: int, rows: int = 1, kv_heads: int = 8) -> Splits:
    """The batch-invariant plan: every row's keys split at the same absolute offsets
    (INVARIANT_SPLIT keys each, whatever the row's length or the batch; 256 cost less than 64
    at an 8B model's decode row: fewer programs and partials), stepped through in the same
    blocks, merged by the same path and warps, with queries in one tile shape
    (INVARIANT_QUERY_ROWS, whatever the method): a query reduces its keys exactly alike as a
    decode row, inside a verify window, or beside any other rows. Keys past a query's own
    position are masked, which adds exact zeros. Under the interpreter, one split over the
    whole cache, which is as fixed, in 64-key steps (its summed tile products, tile_dot, stay
    small).

    The last program to finish merges them for caches of up to INVARIANT_MERGE_MOST splits (4096 keys): it
    reads only the row's live splits (one a 256 keys it holds), so a short row's merge is short,
    and a combine launch a layer is gone (the tiny pair's round runs 18 attention launches).

    Each (row, kv head) launches one program a split up to INVARIANT_PROGRAMS over the batch's
    ``rows``, fewer past it, each taking every so-many of the row's splits. At 64 rows over the
    8B specs' 4,144-position cache (17 splits), 17 programs a (row, kv head), of which a
    256-key row used one, took about a third of a plain step's time on an H200; two take under
    a third of that. Which program takes a split changes no bit. A long row among many short ones
    now runs its splits two programs deep (not measured)."""
    if interpreted():
        return Splits(1, triton.next_power_of_2(max_len), merge=True, rows=INVARIANT_QUERY_ROWS)
    split = min(INVARIANT_SPLIT, triton.next_power_of_2(max_len))
    count = triton.cdiv(max_len, split)
    programs = min(count, max(1, INVARIANT_PROGRAMS // (rows * kv_heads)))
    return Splits(count, split, merge=count <= INVARIANT_MERGE_MOST, rows=INVARIANT_QUERY_ROWS,
                  programs=programs)


def device_split_plan(max_len: int, rows: int = 1, kv_heads: int = 8) -> Splits:
    """Splits for ``rows`` rows over a cache of ``max_len`` keys: about 128 programs along the
    keys of a long row (16 splits of each of one row's 8 kv heads, 2 from eight rows on), none
    under 128 keys (a quarter of a short cache). On an H200 (attention and its combine, µs a
    layer, against the fixed 64-key splits of one row and 512-key splits of sixteen before):
    one row's 528-key verify of 16 tokens 9.5 against 11.9; sixteen such rows 26.4 against
    44.0; one 4001-key row of one token 10.1 against 11.8.

    A row of at most four splits merges them in its last program (
    cases, same units): sixteen rows' verify 19.1 against 27.8 with a combine kernel, four
    rows' 11.0 against 15.3. One row's sixteen splits would leave one program a long serial
    merge (10.4 against 9.8 at 528 keys, 14.4 against 10.8 at 4001): one row keeps the combine."""
    least = min(128, max(16, triton.next_power_of_2(max_len) // 4))
    count = min(max(2, 128 // (rows * kv_heads)), triton.cdiv(max_len, least))
    return Splits(count, least, merge=count <= 4)


def _combine_warps(elements: int, query_rows: int) -> int:
    """Warps for a combine program merging ``elements`` partial values of one query row, with
    ``query_rows`` such programs per (row, kv head). Many short programs (a 16-token window)
    finish sooner with 2 warps (DFlash's batch-1 rounds on an H200); one token (4 query rows)
    keeps 4, where 2 had been slower."""
    if elements > 8192:
        return 8
    return 2 if query_rows > 4 else 4


def attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, kv_len: Tensor, causal: bool,
           splits: Splits, out: Tensor | None = None, tickets: Tensor | None = None, pages: Pages | None = None
           ) -> Tensor:
    """q [N, Hq, W, D] over each row's cached keys -> out [N, Hq, W, D] in q's dtype. q and out
    may have any strides with unit stride along D: the fused stack passes [N, W, Hq, D] buffers
    viewed transposed, so the output projection reads them without a copy. The cache's keys lie
    in ``pages`` (pages.py; without, the cache [slots, Hkv, max_len, D] is its own pages); a
    row's length is at most ``max_len``, its table's pages times their size."""
    n, hq, w, d = q.shape
    pages = Pages.of(k_cache, pages)
    hkv, max_len = k_cache.shape[1], pages.table.shape[1] * pages.size
    g = hq // hkv
    block_m = splits.rows or max(16, triton.next_power_of_2(g * w))
    if g * w > block_m:
        raise ValueError(f"attend: {g * w} query rows per kv head do not fit the plan's {block_m}-row tile")
    padded = triton.next_power_of_2(splits.count)
    if q.stride(3) != 1:
        q = q.contiguous()
    # A merging program reads its row's partials alone: in q's dtype they are half the bytes.
    o_part = torch.empty(n * hkv * padded * block_m * d, dtype=q.dtype if splits.merge else torch.float32,
                         device=q.device)
    lse_part = torch.empty(n * hkv * padded * block_m, dtype=torch.float32, device=q.device)
    if not splits.merge:
        tickets = lse_part  # not read
    elif tickets is None:
        tickets = torch.zeros(n * hkv, dtype=torch.int32, device=q.device)
    elif tickets.numel() < n * hkv:
        raise ValueError(f"attend: {tickets.numel()} tickets for {n} rows x {hkv} kv heads; "
                         "give at least one per (row, kv head), as StaticKV.tickets does")
    if out is None:
        out = torch.empty(n, w, hq, d, dtype=q.dtype, device=q.device).transpose(1, 2)
    plan = (splits.count, splits.least)
    _attend_kernel[(n * hkv, splits.launched)](
        q, k_cache, v_cache, slots, kv_len, *launch_args(pages), o_part, lse_part, tickets, out, d**-0.5, hq, hkv,
        w, g, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), q.stride(0), q.stride(1), q.stride(2),
        out.stride(0), out.stride(1), out.stride(2), *plan, pages.table.shape[0], k_cache.shape[0], max_len,
        CAUSAL=causal, SPLITS=padded, MERGE=splits.merge, BLOCK_M=block_m, BLOCK_N=splits.block, D=d,
        PAGE=page_size(pages),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 stays exact for differential tests
        num_warps=4 if block_m <= 64 else 8, **overlap.launch(release=False),
        PREFETCH=overlap.enabled(), LINES=max(1, d * k_cache.element_size() // 128), SUMMED=summed(splits.rows > 0))
    if splits.merge:
        return out
    _combine_kernel[(n * hkv, g * w)](o_part, lse_part, kv_len, out, hq, hkv, w, g, out.stride(0),
                                      out.stride(1), out.stride(2), *plan, SPLITS=padded,
                                      BLOCK_M=block_m, BLOCK_N=splits.block, D=d,
                                      num_warps=_combine_warps(padded * d, splits.rows or g * w),
                                      **overlap.launch(release=False))
    return out


@dataclass(frozen=True)
class CacheAttention:
    """The AttentionFn for rows over one model's static cache: store the new K/V, attend.

    ``kv_len`` [N] int32 counts each row's keys including its W new tokens; ``slots`` [N]
    int32 picks its cache slot. Both are device tensors the caller fills before a replay.
    """

    k: list[Tensor]  # per layer [pages, Hkv, page size, D]
    v: list[Tensor]
    slots: Tensor  # [N] int32
    kv_len: Tensor  # [N] int32
    causal: bool
    splits: Splits
    tickets: Tensor | None = None  # [>= N * Hkv] int32 zeros, kept zero between launches (attend)
    pages: Pages | None = None  # where each slot's positions lie (None: the cache is its own pages)

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        store_kv(k, v, self.k[layer], self.v[layer], self.slots, self.kv_len, self.pages)
        return attend(q, self.k[layer], self.v[layer], self.slots, self.kv_len, self.causal, self.splits,
                      tickets=self.tickets, pages=self.pages)


def attention_bandwidth(cfg, dtype: torch.dtype, dev: torch.device, contexts: list[int], batch: int, width: int
                        ) -> list[tuple[int, float, float, float]]:
    """(draftline bench --attention) The verify attention kernel alone over the target's KV geometry: (context, µs, TB/s of
    KV read, µs of PyTorch's scaled_dot_product_attention over the same keys as a contiguous
    tensor with an explicit mask) per context length, for `batch` rows of `width` queries."""
    from draftline.core.benchmark import graphed, median_ms

    out = []
    for ctx in contexts:
        shape = (batch + 1, cfg.num_kv_heads, ctx + width, cfg.head_dim)
        k = torch.randn(shape, dtype=dtype, device=dev)
        v = torch.randn(shape, dtype=dtype, device=dev)
        q = torch.randn(batch, cfg.num_heads, width, cfg.head_dim, dtype=dtype, device=dev)
        new = torch.randn(batch, cfg.num_kv_heads, width, cfg.head_dim, dtype=dtype, device=dev)
        slots = torch.arange(batch, device=dev)
        lengths = torch.full((batch,), ctx + width, device=dev)
        attn = CacheAttention([k], [v], slots, lengths, True, split_plan(ctx + width, batch, cfg.num_kv_heads))
        ms = median_ms(graphed(lambda: attn(0, q, new, new)), repeats=50)  # replayed: no launch gaps
        read = 2 * batch * (ctx + width) * cfg.num_kv_heads * cfg.head_dim * k.element_size()
        keys, values = k[:batch], v[:batch]
        own = torch.arange(ctx, ctx + width, device=dev)[:, None]
        mask = torch.arange(ctx + width, device=dev)[None, :] <= own  # [W, S]
        sdpa = median_ms(graphed(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=True)), repeats=50)
        out.append((ctx, 1e3 * ms, read / (ms / 1e3) / 1e12, 1e3 * sdpa))
        del k, v
    return out
