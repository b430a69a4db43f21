"""Attention over the static KV cache: the new tokens' K/V are stored at their positions, then
each row's queries attend over its own cached length, split along the keys (flash-decoding).

Cache layout per layer: [slots, Hkv, max_len, D], so one (slot, head)'s keys are contiguous.
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


@triton.jit
def _store_kernel(k_new, v_new, k_cache, v_cache, slots, kv_len, W,
                  skn, skh, skt, svn, svh, svt, sc_slot, sc_head, sc_pos,
                  D: tl.constexpr, PDL: tl.constexpr):
    """One program per (row, new token, kv head): copy its k and v rows into the cache."""
    overlap.gate(PDL)
    pid, h = tl.program_id(0), tl.program_id(1)
    n, t = pid // W, pid % W
    slot = tl.load(slots + n).to(tl.int64)
    pos = (tl.load(kv_len + n) - W + t).to(tl.int64)
    d = tl.arange(0, D)
    dst = slot * sc_slot + h * sc_head + pos * sc_pos + d
    tl.store(k_cache + dst, tl.load(k_new + n * skn + h * skh + t * skt + d))
    tl.store(v_cache + dst, tl.load(v_new + n * svn + h * svh + t * svt + d))


@triton.jit
def _attend_kernel(q, k_cache, v_cache, slots, kv_len, o_part, lse_part, scale,
                   HQ, HKV, W, G, sc_slot, sc_head, sc_pos, sq_n, sq_h, sq_t,
                   CAUSAL: tl.constexpr, SPLIT: tl.constexpr, SPLITS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr,
                   PDL: tl.constexpr):
    """Program (row n, kv head h, split s): the G*W query rows of h's query heads over keys
    [s*SPLIT, (s+1)*SPLIT) ∩ [0, kv_len); writes the normalized partial output and its
    log-sum-exp (-inf where the split saw no key)."""
    overlap.gate(PDL)
    pid, s = tl.program_id(0), tl.program_id(1)
    n, h = pid // HKV, pid % HKV
    m = tl.arange(0, BLOCK_M)  # query row = g * W + t
    d = tl.arange(0, D)
    rows = G * W
    q_row = n * sq_n + (h * G + m // W) * sq_h + (m % W) * sq_t  # [BLOCK_M]
    q_tile = tl.load(q + q_row[:, None] + d[None, :], mask=m[:, None] < rows, other=0.0)
    length = tl.load(kv_len + n)
    own = length - W + m % W  # each query's own position
    slot = tl.load(slots + n).to(tl.int64)
    base = slot * sc_slot + h * sc_head
    lo = s * SPLIT
    hi = tl.minimum(lo + SPLIT, length)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        inside = j < hi
        k_tile = tl.load(k_cache + base + j[:, None] * sc_pos + d[None, :], mask=inside[:, None], other=0.0)
        scores = tl.dot(q_tile, tl.trans(k_tile), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N] fp32
        visible = inside[None, :]
        if CAUSAL:
            visible = visible & (j[None, :] <= own[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_tile = tl.load(v_cache + base + j[:, None] * sc_pos + d[None, :], mask=inside[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=PRECISION)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    part = (pid * SPLITS + s) * BLOCK_M
    live = (lo + 0 * m) < length  # [BLOCK_M]; splits past the row's keys write nothing: never read
    tl.store(o_part + (part + m[:, None]) * D + d[None, :], out, mask=live[:, None])
    tl.store(lse_part + part + m, lse, mask=live)


@triton.jit
def _combine_kernel(o_part, lse_part, kv_len, out, HQ, HKV, W, G, SPLIT, so_n, so_h, so_t,
                    SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr):
    """Program (row, kv head, query row m): merge the row's live splits by their log-sum-exps,
    all splits in one vectorized pass."""
    overlap.gate(PDL)
    pid, m = tl.program_id(0), tl.program_id(1)
    n, h = pid // HKV, pid % HKV
    s = tl.arange(0, SPLITS)
    live = s < tl.cdiv(tl.load(kv_len + n), SPLIT)
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


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, kv_len: Tensor) -> None:
    """k, v [N, Hkv, W, D] (any strides) -> cache rows at positions kv_len - W .. kv_len - 1."""
    n, hkv, w, d = k.shape
    _store_kernel[(n * w, hkv)](k, v, k_cache, v_cache, slots, kv_len, w, k.stride(0), k.stride(1), k.stride(2),
                                v.stride(0), v.stride(1), v.stride(2), k_cache.stride(0), k_cache.stride(1),
                                k_cache.stride(2), D=d, **overlap.launch(release=False))


def split_size(max_len: int, rows: int = 1) -> int:
    """Keys per split: enough splits to spread the rows over the chip (one 500-token row still
    gets several programs per head), never under 64; splits past a row's length are idle but
    still launched and combined. So more rows get fewer, longer splits: 64 splits of a
    4096-key cache for one row, 8 from eight rows on (on an H200, 16 rows of a 512-token
    verify ran 1.6 ms a round faster with 8 splits than with 64; one row, 0.18-0.25 ms slower)."""
    return max(64, triton.next_power_of_2(triton.cdiv(max_len, max(8, 64 // rows))))


def attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, kv_len: Tensor, causal: bool,
           split: int, out: Tensor | None = None) -> Tensor:
    """q [N, Hq, W, D] over each row's cached keys -> out [N, Hq, W, D] in q's dtype. q and out
    may have any strides with unit stride along D: the fused stack passes [N, W, Hq, D] buffers
    viewed transposed, so the output projection reads them without a copy."""
    n, hq, w, d = q.shape
    hkv, max_len = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    block_m = max(16, triton.next_power_of_2(g * w))
    splits = triton.cdiv(max_len, split)
    padded = triton.next_power_of_2(splits)
    if q.stride(3) != 1:
        q = q.contiguous()
    o_part = torch.empty(n * hkv * padded * block_m * d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(n * hkv * padded * block_m, dtype=torch.float32, device=q.device)
    _attend_kernel[(n * hkv, splits)](
        q, k_cache, v_cache, slots, kv_len, o_part, lse_part, d**-0.5, hq, hkv, w, g,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), q.stride(0), q.stride(1), q.stride(2),
        CAUSAL=causal, SPLIT=split, SPLITS=padded, BLOCK_M=block_m, BLOCK_N=min(64, split), D=d,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 stays exact for differential tests
        num_warps=4 if block_m <= 64 else 8, **overlap.launch(release=False))
    if out is None:
        out = torch.empty(n, w, hq, d, dtype=q.dtype, device=q.device).transpose(1, 2)
    _combine_kernel[(n * hkv, g * w)](o_part, lse_part, kv_len, out, hq, hkv, w, g, split, out.stride(0),
                                      out.stride(1), out.stride(2), SPLITS=padded,
                                      BLOCK_M=block_m, D=d, num_warps=4 if padded * d <= 8192 else 8,
                                      **overlap.launch(release=False))
    return out


@dataclass(frozen=True)
class CacheAttention:
    """The AttentionFn for rows over one model's static cache: store the new K/V, attend.

    ``kv_len`` [N] int32 counts each row's keys including its W new tokens; ``slots`` [N]
    int32 picks its cache slot. Both are device tensors the caller fills before a replay.
    """

    k: list[Tensor]  # per layer [slots, Hkv, max_len, D]
    v: list[Tensor]
    slots: Tensor  # [N] int32
    kv_len: Tensor  # [N] int32
    causal: bool
    split: int

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        store_kv(k, v, self.k[layer], self.v[layer], self.slots, self.kv_len)
        return attend(q, self.k[layer], self.v[layer], self.slots, self.kv_len, self.causal, self.split)
