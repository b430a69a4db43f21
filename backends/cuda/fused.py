"""The target's verify forward with fused kernels: the same weights and math as
core.models.target, in ten launches per layer instead of about sixty.

Per layer: add+RMSNorm, one QKV matmul, q/k-norm + RoPE + KV store, attention (split, combine),
the output matmul, add+RMSNorm, one gate-up matmul, SiLU·up, the down matmul. The residual
add of each block is deferred into the next norm, whose kernel also writes the sum: that sum
is the layer's output hidden state, so tapped features cost nothing extra. q/k/v and gate/up
weights are concatenated once, and the modules' own weights become views into them, so the
eager modules (prefill) and this path share one copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from core.models.target import TargetModel

from .attention import attend
from .kv import RowsAttention


@triton.jit
def _add_norm_kernel(a, h, w, h_out, y_out, H, eps, HAS_ADD: tl.constexpr, BLOCK: tl.constexpr):
    """Row r: s = a + h (rounded to the model dtype, as an eager add is), y = rmsnorm(s) * w."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < H
    s = tl.load(h + r * H + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_ADD:
        s = s + tl.load(a + r * H + cols, mask=inside, other=0.0).to(tl.float32)
        s = s.to(h_out.dtype.element_ty)
        tl.store(h_out + r * H + cols, s, mask=inside)
        s = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / H + eps)
    normed = (s * rstd).to(y_out.dtype.element_ty)
    weight = tl.load(w + cols, mask=inside, other=0.0)
    tl.store(y_out + r * H + cols, (weight * normed).to(y_out.dtype.element_ty), mask=inside)


@triton.jit
def _qkv_kernel(qkv, q_norm, k_norm, inv_freq, positions, q_out, k_cache, v_cache, slots, kv_len,
                HQ, HKV, W, eps, sc_slot, sc_head, sc_pos,
                QK_NORM: tl.constexpr, D: tl.constexpr):
    """Program (token, head) of the fused QKV output: q heads are normed, rotated and written
    as [N, Hq, W, D]; k heads normed, rotated and stored in the cache; v heads stored."""
    tok, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    n, t = tok // W, tok % W
    half = tl.arange(0, D // 2)
    row = qkv + tok * (HQ + 2 * HKV) * D + head * D
    x1 = tl.load(row + half).to(tl.float32)
    x2 = tl.load(row + D // 2 + half).to(tl.float32)
    pos = tl.load(positions + tok)
    slot = tl.load(slots + n).to(tl.int64)
    cache_pos = (tl.load(kv_len + n) - W + t).to(tl.int64)
    if head < HQ + HKV:  # q or k: optional per-head RMSNorm, then RoPE (rotate-half)
        if QK_NORM:
            dt = q_out.dtype.element_ty
            if head < HQ:
                w = q_norm
            else:
                w = k_norm
            rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
            x1 = (tl.load(w + half) * (x1 * rstd).to(dt)).to(tl.float32)
            x2 = (tl.load(w + D // 2 + half) * (x2 * rstd).to(dt)).to(tl.float32)
        freq = pos.to(tl.float32) * tl.load(inv_freq + half)
        cos = tl.cos(freq).to(q_out.dtype.element_ty).to(tl.float32)
        sin = tl.sin(freq).to(q_out.dtype.element_ty).to(tl.float32)
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        if head < HQ:
            dst = q_out + ((n * HQ + head) * W + t) * D
        else:
            dst = k_cache + slot * sc_slot + (head - HQ) * sc_head + cache_pos * sc_pos
        tl.store(dst + half, o1.to(q_out.dtype.element_ty))
        tl.store(dst + D // 2 + half, o2.to(q_out.dtype.element_ty))
    else:
        dst = v_cache + slot * sc_slot + (head - HQ - HKV) * sc_head + cache_pos * sc_pos
        tl.store(dst + half, x1.to(q_out.dtype.element_ty))
        tl.store(dst + D // 2 + half, x2.to(q_out.dtype.element_ty))


@triton.jit
def _silu_mul_kernel(gu, out, I, BLOCK: tl.constexpr):
    r, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    inside = cols < I
    g = tl.load(gu + r * 2 * I + cols, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(gu + r * 2 * I + I + cols, mask=inside, other=0.0)
    silu = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    tl.store(out + r * I + cols, silu * u, mask=inside)


def add_norm(a: Tensor | None, h: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(h + a, rmsnorm(h + a) * weight) over rows of h [..., H]; with a None, (h, rmsnorm(h))."""
    flat = h.reshape(-1, h.shape[-1])
    rows, width = flat.shape
    total = torch.empty_like(flat) if a is not None else flat
    normed = torch.empty_like(flat)
    _add_norm_kernel[(rows,)](flat if a is None else a.reshape(rows, width), flat, weight, total, normed, width, eps,
                              HAS_ADD=a is not None, BLOCK=triton.next_power_of_2(width))
    return total.view(h.shape), normed.view(h.shape)


def silu_mul(gu: Tensor) -> Tensor:
    rows, inter = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gu.dtype, device=gu.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gu, out, inter, BLOCK=block)
    return out


def _fuse(linears: list[torch.nn.Linear]) -> Tensor:
    """One weight for several projections of the same input; each module's weight becomes a view."""
    if any(lin.bias is not None for lin in linears):
        raise ValueError("fused projections with biases are not supported")
    fused = torch.cat([lin.weight.data for lin in linears])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = fused[start : start + rows]
        start += rows
    return fused


class FusedTarget:
    """Verify-window forwards of a TargetModel over a static cache (see module docstring)."""

    def __init__(self, target: TargetModel):
        self.target, self.cfg = target, target.config
        fused = getattr(target, "fused_weights", None)  # another engine over these weights fused them
        if fused is None:
            fused = [(_fuse([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj]),
                      _fuse([l.mlp.gate_proj, l.mlp.up_proj])) for l in target.model.layers]
            target.fused_weights = fused
        self.qkv, self.gate_up = [q for q, _ in fused], [g for _, g in fused]

    def __call__(self, ids: Tensor, positions: Tensor, attn: RowsAttention, taps: tuple[int, ...] = ()
                 ) -> tuple[Tensor, Tensor | None]:
        """ids/positions [N, W] -> (final-normed hidden [N, W, H], taps [N, W, len(taps)*H] or None)."""
        cfg, model = self.cfg, self.target.model
        n, w = ids.shape
        cache, slots, kv_len = attn.cache, attn.rows.slots, attn.kv_len(w)
        h = model.embed_tokens(ids).view(n * w, -1)  # [N*W, H]
        pending, tapped = None, {}
        for i, layer in enumerate(model.layers):
            h, x = add_norm(pending, h, layer.input_layernorm.weight, cfg.rms_norm_eps)
            if i - 1 in taps:
                tapped[i - 1] = h
            q = self._qkv(i, layer, x, positions, cache, slots, kv_len, n, w)
            out = attend(q, cache.k[i], cache.v[i], slots, kv_len, True, cache.split)  # [N, Hq, W, D]
            a = layer.self_attn.o_proj(out.transpose(1, 2).reshape(n * w, -1))
            h, x = add_norm(a, h, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
            pending = layer.mlp.down_proj(silu_mul(F.linear(x, self.gate_up[i])))
        h, x = add_norm(pending, h, model.norm.weight, cfg.rms_norm_eps)
        last = len(model.layers) - 1
        if last in taps:
            tapped[last] = h
        features = torch.cat([tapped[t] for t in taps], dim=-1).view(n, w, -1) if taps else None
        return x.view(n, w, -1), features

    def _qkv(self, i: int, layer, x: Tensor, positions: Tensor, cache, slots: Tensor, kv_len: Tensor, n: int, w: int
             ) -> Tensor:
        cfg, a = self.cfg, layer.self_attn
        qkv = F.linear(x, self.qkv[i])  # [N*W, (Hq + 2 Hkv) D]
        q = torch.empty(n, cfg.num_heads, w, cfg.head_dim, dtype=x.dtype, device=x.device)
        norm_q = a.q_norm.weight if cfg.qk_norm else qkv
        norm_k = a.k_norm.weight if cfg.qk_norm else qkv
        k_cache = cache.k[i]
        _qkv_kernel[(n * w, cfg.num_heads + 2 * cfg.num_kv_heads)](
            qkv, norm_q, norm_k, self.target.rotary.inv_freq, positions, q, k_cache, cache.v[i], slots, kv_len,
            cfg.num_heads, cfg.num_kv_heads, w, cfg.rms_norm_eps, k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), QK_NORM=cfg.qk_norm, D=cfg.head_dim)
        return q
