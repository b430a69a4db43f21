"""The q/k/v kernel: a layer's fused q/k/v projection (or its partial sums) into per-head
q/k RMSNorm, RoPE (rotate-half) and the K/V store, in one launch: q comes back as [N, W, Hq, D],
k and v go to the cache at each row's positions (kv_len - W .. kv_len - 1), through its pages.
A query-only layer (frozen-KV MTP) stores nothing; a DFlash context's keys have no q."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from . import overlap
from .matvec import interpreted
from .norm import _summed
from .pages import launch_args, page_size, paged


@triton.jit
def _qkv_kernel(qkv, q_norm, k_norm, inv_freq, positions, q_out, k_cache, v_cache, slots, kv_len, table, ts,
                HQ, HKV, W, eps, sc_page, sc_head, sc_pos, part_stride, N_TOK,
                QK_NORM: tl.constexpr, PARTS: tl.constexpr, D: tl.constexpr, HEADS: tl.constexpr,
                TOKENS: tl.constexpr, PAGE: tl.constexpr, PDL: tl.constexpr):
    """Program (block of TOKENS tokens, block of HEADS heads) of the fused QKV output (PARTS
    partial sums of it), one tile row per (token, head): q heads are normed, rotated and written
    as [N, W, Hq, D]; k heads normed, rotated and stored in the cache; v heads stored. Each
    head's math is the same whatever TOKENS and HEADS are."""
    overlap.gate(PDL)
    r = tl.arange(0, TOKENS * HEADS)  # [R]: the tile's rows
    tok = tl.program_id(0).to(tl.int64) * TOKENS + r // HEADS
    head = tl.program_id(1) * HEADS + r % HEADS
    real = tok < N_TOK
    n, t = tok // W, tok % W
    half = tl.arange(0, D // 2)
    is_q = (head < HQ) & real
    is_k = (head >= HQ) & (head < HQ + HKV) & real
    is_v = (head >= HQ + HKV) & (head < HQ + 2 * HKV) & real
    live = (is_q | is_k | is_v)[:, None] & (half < D)[None, :]  # [R, D/2]
    at = tok[:, None] * (HQ + 2 * HKV) * D + head.to(tl.int64)[:, None] * D + half[None, :]
    dt = q_out.dtype.element_ty
    x1 = _summed(qkv, at, live, part_stride, dt, PARTS)
    x2 = _summed(qkv, at + D // 2, live, part_stride, dt, PARTS)
    pos = tl.load(positions + tok, mask=real, other=0)
    slot = tl.load(slots + n, mask=real, other=0).to(tl.int64)
    cache_pos = (tl.load(kv_len + n, mask=real, other=0) - W + t).to(tl.int64)
    v1, v2 = x1, x2  # v heads: stored as they are
    if QK_NORM:  # q and k heads: per-head RMSNorm with their own weight
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)  # [R]
        w1 = tl.where(is_q[:, None], tl.load(q_norm + half)[None, :], tl.load(k_norm + half)[None, :])
        w2 = tl.where(is_q[:, None], tl.load(q_norm + D // 2 + half)[None, :], tl.load(k_norm + D // 2 + half)[None, :])
        x1 = (w1 * (x1 * rstd[:, None]).to(dt)).to(tl.float32)
        x2 = (w2 * (x2 * rstd[:, None]).to(dt)).to(tl.float32)
    freq = pos.to(tl.float32)[:, None] * tl.load(inv_freq + half)[None, :]  # RoPE, rotate-half
    cos = tl.cos(freq).to(dt).to(tl.float32)
    sin = tl.sin(freq).to(dt).to(tl.float32)
    o1, o2 = (x1 * cos - x2 * sin).to(dt), (x2 * cos + x1 * sin).to(dt)
    row = head.to(tl.int64)[:, None]
    q_dst = q_out + (tok[:, None] * HQ + row) * D + half[None, :]
    tl.store(q_dst, o1, mask=live & is_q[:, None])
    tl.store(q_dst + D // 2, o2, mask=live & is_q[:, None])
    stored = (is_k | is_v) & (cache_pos >= 0)
    cached = paged(table, ts, slot, cache_pos, stored, PAGE, sc_page, sc_pos)[:, None] + half[None, :]
    k_dst = k_cache + cached + (row - HQ) * sc_head
    tl.store(k_dst, o1, mask=live & (is_k & stored)[:, None])
    tl.store(k_dst + D // 2, o2, mask=live & (is_k & stored)[:, None])
    v_dst = v_cache + cached + (row - HQ - HKV) * sc_head
    tl.store(v_dst, v1.to(dt), mask=live & (is_v & stored)[:, None])
    tl.store(v_dst + D // 2, v2.to(dt), mask=live & (is_v & stored)[:, None])


QKV_WARPS = 1  # a GPU program's tile (at most QKV_TILE elements) is one warp's
QKV_TILE = 128  # elements of D/2 half-rows a GPU program holds at most ...
QKV_MOST_HEADS = 4  # ... in at most this many heads: 4 for D 32 (the tiny pair), 2 for D 128 (the 8B)


def qkv_tiles(tokens: int, heads: int, head_dim: int) -> tuple[tuple[int, int], int, int]:
    """(grid, TOKENS, HEADS) of the q/k/v kernel over ``tokens`` rows of ``heads`` heads. On the
    GPU a program holds one token's heads_per_program(heads, head_dim) heads: a shape of the
    model's alone, so a token's bits do not depend on the batch. Under the interpreter, which
    runs programs one after another and pays per tile op, not per element, every head of as
    many tokens as fill 1024 tile rows (64 tokens of 16 heads) goes in one program."""
    if not interpreted():
        per_head = heads_per_program(heads, head_dim)
        return (tokens, triton.cdiv(heads, per_head)), 1, per_head
    per_head = triton.next_power_of_2(heads)
    per_token = min(triton.next_power_of_2(tokens), max(1, 1024 // per_head))
    return (triton.cdiv(tokens, per_token), 1), per_token, per_head


def heads_per_program(heads: int, head_dim: int) -> int:
    """A GPU program's heads, from the model's shape alone (bench/qkv_tiles.py, µs a launch for
    1, 2 and 4 heads a program): the tiny pair at 256 tokens 2.96, 1.69, 1.47 and at 16 tokens
    1.20, 1.17, 1.19; the 8B at 512 tokens 30.3, 15.5, 8.9 but at 1 token 1.13, 1.32, 2.38 (its
    batch-1 step runs 36 of them)."""
    fill = max(1, QKV_TILE // (head_dim // 2))
    return min(triton.next_power_of_2(heads), QKV_MOST_HEADS, fill)


def project_heads(module: nn.Module, proj: Tensor, positions: Tensor, rotary: nn.Module, cache, layer: int,
                  slots: Tensor, kv_len: Tensor, queries: bool = True, keys: bool = True) -> Tensor | None:
    """q/k-norm, RoPE and the K/V store for a projection [N*W, (Hq + 2Hkv) * D] (or its partial
    sums [parts, N*W, ...]) holding the q heads (``queries``) and the k and v heads (``keys``)
    of ``module``, keys into layer ``layer`` of ``cache`` (a StaticKV) -> q [N, Hq, W, D], a view
    of [N, W, Hq, D] (None without queries)."""
    n, w = positions.shape
    positions = positions.contiguous()  # the kernel reads token t's at t (an expanded tensor's are not there)
    hq = module.num_heads if queries else 0
    hkv = module.num_kv_heads if keys else 0
    q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    q_norm, k_norm = q_norm or k_norm, k_norm or q_norm  # a query-only module has a q norm alone
    k_cache = cache.k[layer]
    d = module.head_dim
    q = torch.empty(n, w, hq, d, dtype=k_cache.dtype, device=proj.device) if queries else k_cache
    parts = proj.numel() // (n * w * (hq + 2 * hkv) * d)
    grid, tokens, heads = qkv_tiles(n * w, hq + 2 * hkv, d)
    _qkv_kernel[grid](
        proj, proj if q_norm is None else q_norm.weight, proj if k_norm is None else k_norm.weight, rotary.inv_freq,
        positions, q, k_cache, cache.v[layer], slots, kv_len, *launch_args(cache.pages), hq, hkv, w,
        0.0 if k_norm is None else k_norm.eps, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        proj.stride(0) if parts > 1 else 0, n * w, QK_NORM=q_norm is not None, PARTS=parts, D=d, HEADS=heads,
        TOKENS=tokens, PAGE=page_size(cache.pages), num_warps=QKV_WARPS, **overlap.launch(release=True))
    return q.transpose(1, 2) if queries else None
