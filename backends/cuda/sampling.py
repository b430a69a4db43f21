"""Triton kernels for sampling and acceptance, keyed like core/sampling.py bit for bit.

The keyed hash is 32-bit integer arithmetic, so the kernels reproduce draftline.core.sampling's noise
exactly; the Gumbel transform is float32 in both. No torch.Generator: safe inside a graph.
Under TRITON_INTERPRET=1 these run on the CPU, which is how CI checks them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _mul32(x, c: tl.constexpr):
    return x * c  # uint32 arithmetic wraps modulo 2^32, as draftline.core.sampling._mul32 emulates


@triton.jit
def _hash32(x):
    """lowbias32 on uint32 values (draftline.core.sampling.hash32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@triton.jit
def _row_key(seed, position, STREAM: tl.constexpr):
    """draftline.core.sampling.row_key for one row: seed int64, position int64 -> uint32 key."""
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    k = _hash32(_hash32(lo) ^ hi)
    k = _hash32(k ^ (position & 0xFFFFFFFF).to(tl.uint32))
    return _hash32(k ^ STREAM)


@triton.jit
def _uniform(key):
    """draftline.core.sampling.uniform for one key: float32 strictly inside (0, 1)."""
    return ((_hash32(key) >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


_SAMPLE = tl.constexpr(1)  # draftline.core.sampling.Stream.SAMPLE, readable inside kernels

# what _gumbel_argmax reads from its rows (constexpr: jit functions may read such globals)
LOGP, PROBS, RESIDUAL, LOGITS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)


@triton.jit
def _gumbel(key, cols):
    """Gumbel noise of each column for a row's key."""
    return -tl.log(-tl.log(_uniform(_hash32(key ^ _hash32(cols.to(tl.uint32) + 0x9E3779B9)))))


@triton.jit
def _best(row, q_row, key, lo, hi, BLOCK: tl.constexpr, MODE: tl.constexpr, use_q=True, inv_temp=1.0):
    """(max, argmax) over columns [lo, hi) of log w + Gumbel(key, column), ties to the lower
    index, where w is ``row`` as log-probabilities (LOGP) or probabilities (PROBS), or
    max(0, row - q_row) (RESIDUAL; just ``row`` when not use_q), or softmax(row * inv_temp)
    from raw logits (LOGITS; inv_temp 0 is greedy: the plain argmax, no noise). Unnormalized w
    is fine: a constant shift of every log cannot move the argmax. Third, for LOGITS, how many
    of the columns are not finite (counted in the same pass)."""
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.full((), 0, tl.int64)
    bad = tl.full((), 0, tl.int32)
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < hi
        if MODE == LOGP:
            lp = tl.load(row + cols, mask=inside, other=float("-inf")).to(tl.float32)
        elif MODE == LOGITS:
            x = tl.load(row + cols, mask=inside, other=float("-inf")).to(tl.float32)
            bad += tl.sum((inside & ((x != x) | (tl.abs(x) == float("inf")))).to(tl.int32), axis=0)
            lp = x * tl.where(inv_temp > 0, inv_temp, 1.0)
        else:
            w = tl.load(row + cols, mask=inside, other=0.0).to(tl.float32)
            if MODE == RESIDUAL:
                q = tl.load(q_row + cols, mask=inside, other=0.0).to(tl.float32)
                w = tl.where(use_q, tl.maximum(w - q, 0.0), w)
            lp = tl.log(w)
        if MODE == LOGITS:  # a greedy row skips the noise: hashing every column is what a draw costs
            noise = tl.zeros((BLOCK,), tl.float32)
            if inv_temp > 0:
                noise = _gumbel(key, cols)
        else:
            noise = _gumbel(key, cols)
        val = tl.where(inside, lp + noise, float("-inf"))
        blk_val = tl.max(val, axis=0)
        blk_idx = tl.argmax(val, axis=0).to(tl.int64) + start
        better = blk_val > best_val
        best_idx = tl.where(better, blk_idx, best_idx)
        best_val = tl.where(better, blk_val, best_val)
    return best_val, best_idx, bad


@triton.jit
def keyed_scores(v, mask, rm, rn, M, W, SHIFT, seed, start, inv_temp):
    """Raw logits v [BLOCK_M, BLOCK_N] of rows rm (row m: request m // W, position
    start + SHIFT + m % W) at columns rn -> (what _best draws from them in LOGITS mode, bit for
    bit, and each row's count of non-finite values where ``mask``): a matvec's epilogue folds
    a draw with these (matvec.matvec_draw), so the logits need no second pass."""
    req = rm // W
    live = rm < M
    temp = tl.load(inv_temp + req, mask=live, other=0.0)  # [BLOCK_M]
    count = tl.sum((mask & ((v != v) | (tl.abs(v) == float("inf")))).to(tl.int32), axis=1)
    noise = tl.zeros(v.shape, tl.float32)
    if tl.max(temp, axis=0) > 0:  # greedy rows skip the noise; an all-greedy batch hashes nothing
        position = tl.load(start + req, mask=live, other=0) + SHIFT + rm % W
        key = _row_key(tl.load(seed + req, mask=live, other=0), position, _SAMPLE)
        noise = tl.where((temp > 0)[:, None], _gumbel(key[:, None], rn[None, :]), 0.0)
    return v * tl.where(temp > 0, temp, 1.0)[:, None] + noise, count


@triton.jit
def _gumbel_argmax(row, q_row, key, V, BLOCK: tl.constexpr, MODE: tl.constexpr, use_q=True, inv_temp=1.0):
    """The whole vocabulary's draw (see _best), in one program."""
    return _best(row, q_row, key, 0, V, BLOCK, MODE, use_q, inv_temp)[1]


@triton.jit
def _draw_chunks_kernel(scores, seed, first, shift, inv_temp, vals, idxs, bad, V, W, stride_req, stride_pos,
                        CHUNK, STREAM: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr, MODE: tl.constexpr,
                        COUNT_BAD: tl.constexpr):
    """Program (row r = request * W + t, vocabulary chunk c): the best column of the chunk for
    the draw keyed by (seed, first + shift + t). A draw depends only on its own row and key, so
    every position's draw and every chunk of the vocabulary run in parallel. Chunks past the
    vocabulary (up to the padded CHUNKS) write (-inf, 0). With COUNT_BAD (raw logits) it also
    writes how many of the chunk's scores are not finite to bad [rows, CHUNKS]."""
    r, c = tl.program_id(0), tl.program_id(1)
    req, t = r // W, r % W
    key = _row_key(tl.load(seed + req), tl.load(first + req) + shift + t, STREAM)
    temp = tl.load(inv_temp + req) if MODE == LOGITS else 1.0
    lo = c * CHUNK
    row = scores + req * stride_req + t * stride_pos
    val, idx, count = _best(row, scores, key, lo, tl.minimum(lo + CHUNK, V), BLOCK, MODE, True, temp)
    tl.store(vals + r * CHUNKS + c, val)
    tl.store(idxs + r * CHUNKS + c, idx)
    if COUNT_BAD:
        tl.store(bad + r * CHUNKS + c, count)


@triton.jit
def _pick(vals, idxs, r, CHUNKS: tl.constexpr):
    """Row r's draw from its chunks' bests: the first chunk holding the maximum (lower index)."""
    c = tl.arange(0, CHUNKS)
    best = tl.argmax(tl.load(vals + r * CHUNKS + c), axis=0)
    return tl.load(idxs + r * CHUNKS + best)


@triton.jit
def _pick_kernel(vals, idxs, out, CHUNKS: tl.constexpr):
    r = tl.program_id(0)
    tl.store(out + r, _pick(vals, idxs, r, CHUNKS))


@triton.jit
def _accept_matching_kernel(vals, idxs, drafts, num_out, tok_out, K, CHUNKS: tl.constexpr):
    """One request per program, over the K+1 draws t_i already made (_draw_chunks_kernel):
    accept drafts while they match, write the accepted run then t at the first mismatch (or
    the bonus t_K), and -1 past it. Mirrors draftline.core.sampling._accept_matching."""
    req = tl.program_id(0)
    accepted = tl.full((), 0, tl.int64)
    matching = tl.full((), 1, tl.int1)
    for i in range(0, K + 1):
        if matching:
            t = _pick(vals, idxs, req * (K + 1) + i, CHUNKS)
            d = tl.load(drafts + req * K + i, mask=i < K, other=-1)
            tl.store(tok_out + req * (K + 1) + i, t)
            if d == t:
                accepted += 1
            else:
                matching = False
        else:
            tl.store(tok_out + req * (K + 1) + i, -1)
    tl.store(num_out + req, accepted)


@triton.jit
def _residual_argmax(p_row, q_row, key, V, BLOCK: tl.constexpr):
    """A draw from normalize(max(0, p - q)), or from p when that has no mass."""
    mass = tl.full((), 0.0, tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < V
        p = tl.load(p_row + cols, mask=inside, other=0.0)
        q = tl.load(q_row + cols, mask=inside, other=0.0)
        mass += tl.sum(tl.maximum(p - q, 0.0), axis=0)
    return _gumbel_argmax(p_row, q_row, key, V, BLOCK, RESIDUAL, mass > 0)


@triton.jit
def _accept_rejection_kernel(p, q, drafts, seed, first, num_out, tok_out, V, K, sp_req, sp_pos, sq_req, sq_pos,
                             BLOCK: tl.constexpr):
    """Drafts sampled from q: accept d_i iff u_i * q_i(d_i) < p_i(d_i); at the first rejection
    emit a residual draw, after K acceptances a bonus draw from p_K. Mirrors
    draftline.core.sampling._accept_rejection (streams ACCEPT = 2, RESIDUAL = 3, SAMPLE = 1)."""
    req = tl.program_id(0)
    s, p0 = tl.load(seed + req), tl.load(first + req)
    accepted = tl.full((), 0, tl.int64)
    open_run = tl.full((), 1, tl.int1)
    for i in range(0, K):
        if open_run:
            d = tl.load(drafts + req * K + i)
            p_d = tl.load(p + req * sp_req + i * sp_pos + d)
            q_d = tl.load(q + req * sq_req + i * sq_pos + d)
            if _uniform(_row_key(s, p0 + i, 2)) * q_d < p_d:
                tl.store(tok_out + req * (K + 1) + i, d)
                accepted += 1
            else:
                t = _residual_argmax(p + req * sp_req + i * sp_pos, q + req * sq_req + i * sq_pos,
                                     _row_key(s, p0 + i, 3), V, BLOCK)
                tl.store(tok_out + req * (K + 1) + i, t)
                open_run = False
    if open_run:
        bonus = _gumbel_argmax(p + req * sp_req + K * sp_pos, p, _row_key(s, p0 + K, 1), V, BLOCK, PROBS)
        tl.store(tok_out + req * (K + 1) + K, bonus)
    tl.store(num_out + req, accepted)


SAMPLE_STREAM = 1  # draftline.core.sampling.Stream.SAMPLE
CHUNK = 4096  # vocabulary columns per program of a draw


def _draws(scores: Tensor, seed: Tensor, first: Tensor, stream: int, block: int, inv_temp: Tensor | None,
           chunk: int = CHUNK, bad: Tensor | None = None, shift: int = 0, probs: bool = False
           ) -> tuple[Tensor, Tensor, int]:
    """Every row's draw over scores [N, W, V] (row (n, t) keyed by first[n] + shift + t), per
    chunk of the vocabulary: (best values, best columns) [N * W, chunks], and the padded chunk count.
    The scores are log-probabilities, raw logits with ``inv_temp``, or probabilities with ``probs``.
    ``bad`` [N * W, chunks] int32, when given, gets each real chunk's count of non-finite scores."""
    n, w, v = scores.shape
    if bad is not None and inv_temp is None:
        raise ValueError("_draws: non-finite counts are kept for raw logits (give inv_temp)")
    chunk, real, chunks = chunking(v, chunk)
    vals = torch.empty(n * w, chunks, dtype=torch.float32, device=scores.device)  # every chunk is written
    idxs = torch.empty(n * w, chunks, dtype=torch.int64, device=scores.device)
    _draw_chunks_kernel[(n * w, chunks)](
        scores, seed, first, shift, seed if inv_temp is None else inv_temp, vals, idxs,
        vals if bad is None else bad, v, w, scores.stride(0), scores.stride(1), chunk, STREAM=stream, CHUNKS=chunks,
        BLOCK=min(block, chunk),
        MODE=3 if inv_temp is not None else 1 if probs else 0, COUNT_BAD=bad is not None)  # LOGITS, PROBS or LOGP
    return vals, idxs, chunks


def chunking(v: int, chunk: int = CHUNK) -> tuple[int, int, int]:
    """A draw over v columns: (columns per chunk, real chunks, padded chunks: _draws' row width)."""
    chunk = min(chunk, triton.next_power_of_2(v))
    return chunk, triton.cdiv(v, chunk), triton.next_power_of_2(triton.cdiv(v, chunk))


def sample(logp: Tensor, seed: Tensor, position: Tensor, stream: int = SAMPLE_STREAM, block: int = 1024,
           inv_temp: Tensor | None = None, chunk: int = CHUNK, probs: bool = False) -> Tensor:
    """log-probabilities [N, V] (-inf where filtered) -> ids [N]; as draftline.core.sampling.sample on exp(logp).
    With ``inv_temp`` [N] the rows are raw logits instead, sampled at temperature 1 / inv_temp
    (greedy where it is 0): no softmax pass over the vocabulary; with ``probs``, probabilities."""
    if logp.stride(1) != 1:
        logp = logp.contiguous()
    vals, idxs, chunks = _draws(logp[:, None], seed.contiguous(), position.contiguous(), int(stream), block,
                                inv_temp, chunk, probs=probs)
    out = torch.empty(logp.shape[0], dtype=torch.int64, device=logp.device)
    _pick_kernel[(logp.shape[0],)](vals, idxs, out, CHUNKS=chunks)
    return out


def draw(probs: Tensor, seed: Tensor, position: Tensor, stream: int, block: int = 1024, chunk: int = CHUNK) -> Tensor:
    """probabilities [N, V] -> ids [N]: draftline.core.sampling.sample's draw (as `sample` keeps
    it), in one pass over the vocabulary (a drafter's draw from its q; the reference's keyed hash
    is dozens of elementwise launches, each a node of a captured round)."""
    return sample(probs, seed, position, stream, block, chunk=chunk, probs=True)


def accept_matching(logp: Tensor, drafts: Tensor, seed: Tensor, first: Tensor, block: int = 1024,
                    inv_temp: Tensor | None = None, chunk: int = CHUNK, bad: Tensor | None = None, shift: int = 0
                    ) -> tuple[Tensor, Tensor]:
    """logp [N, K+1, V], drafts [N, K] -> (num_accepted [N], tokens [N, K+1], -1 past the
    emitted token); row (n, t) draws at position first[n] + shift + t. With ``inv_temp`` [N]
    the rows are raw logits, as in `sample`; ``bad`` as in `_draws`."""
    n, k1, v = logp.shape
    if logp.stride(2) != 1:
        logp = logp.contiguous()
    vals, idxs, chunks = _draws(logp, seed, first, SAMPLE_STREAM, block, inv_temp, chunk, bad, shift)
    num = torch.empty(n, dtype=torch.int64, device=logp.device)
    tokens = torch.empty(n, k1, dtype=torch.int64, device=logp.device)
    _accept_matching_kernel[(n,)](vals, idxs, drafts.contiguous(), num, tokens, k1 - 1, CHUNKS=chunks)
    return num, tokens


def accept_rejection(p: Tensor, q: Tensor, drafts: Tensor, seed: Tensor, first: Tensor, block: int = 1024
                     ) -> tuple[Tensor, Tensor]:
    """p [N, K+1, V] and q [N, K, V] probabilities, drafts [N, K] sampled from q ->
    (num_accepted [N], tokens [N, K+1]); tokens past the emitted one are left unwritten."""
    n, k1, v = p.shape
    p, q = p.contiguous().float(), q.contiguous().float()
    num = torch.empty(n, dtype=torch.int64, device=p.device)
    tokens = torch.full((n, k1), -1, dtype=torch.int64, device=p.device)
    _accept_rejection_kernel[(n,)](p, q, drafts.contiguous(), seed, first, num, tokens, v, k1 - 1,
                                   p.stride(0), p.stride(1), q.stride(0), q.stride(1), BLOCK=block)
    return num, tokens


def nonfinite(logits: Tensor) -> Tensor:
    """logits [N, W, V] -> each row-slot's count of non-finite values [N * W, 1] int32, as a
    round's settle reads them (one chunk a slot)."""
    return (~torch.isfinite(logits)).sum(-1).to(torch.int32).view(-1, 1)
