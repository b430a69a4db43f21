"""Decoder building blocks shared by the target family and the drafters: the modules (weights),
and the decoder stack written once over a backend's operations (ops.py). The modules hold no
state; the backend owns the KV layout, the mask and whatever is cached.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig, RopeConfig
from .fp8 import Fp8Linear, linear, quantize_weight
from .ops import Forward, Ops, Partial, Taps


class AttentionFn(Protocol):
    """The eager operations' attention (eager.py): a layer's rotated q and new k, v -> its output."""

    def __call__(self, layer: int, q: Tensor, k: Tensor | None, v: Tensor | None) -> Tensor:
        """q [B, Hq, T, D], k/v [B, Hkv, T, D] (None: a query-only layer) -> out [B, Hq, T, D]"""
        ...


def causal_attention(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Whole sequences, causal, no cache: for training and for uncached scoring."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> Tensor:
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind != "llama3":
        return inv
    # Llama-3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """cos/sin tables computed on the fly from positions (any position, any batch layout)."""

    def __init__(self, rope: RopeConfig, head_dim: int):
        super().__init__()
        self.rope, self.head_dim = rope, head_dim
        self.register_buffer("inv_freq", inverse_frequencies(rope, head_dim), persistent=False)

    def reset(self) -> None:
        """Recompute the table in place (after a model built on the meta device is materialized)."""
        with torch.no_grad():
            self.inv_freq.copy_(inverse_frequencies(self.rope, self.head_dim))

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # [..., T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [..., T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, T, D]; cos/sin [B, T, D] (rotate-half convention)."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """A layer's q/k/v/o projections and per-head q/k norms (Qwen3); Ops.attention runs them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = linear(h, cfg.num_heads * d, cfg.attention_bias, cfg.fp8)
        self.k_proj = linear(h, cfg.num_kv_heads * d, cfg.attention_bias, cfg.fp8)
        self.v_proj = linear(h, cfg.num_kv_heads * d, cfg.attention_bias, cfg.fp8)
        self.o_proj = linear(cfg.num_heads * d, h, cfg.attention_bias, cfg.fp8)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = linear(cfg.hidden_size, cfg.intermediate_size, False, cfg.fp8)
        self.up_proj = linear(cfg.hidden_size, cfg.intermediate_size, False, cfg.fp8)
        self.down_proj = linear(cfg.intermediate_size, cfg.hidden_size, False, cfg.fp8)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def decoder_layer(ops: Ops, fwd: Forward, index: int, layer: nn.Module, rotary: Rotary, h: Tensor, x: Tensor
                  ) -> tuple[Tensor, Partial]:
    """One decoder layer after its input norm: residual h [N, W, H] and normed input x [N, W, In]
    (an EAGLE-3 layer reads 2H) -> (h after attention, the MLP's output): the layer's output is
    their sum, which the next add_norm makes. Its keys are layer ``index`` of fwd.kv's."""
    attended = ops.attention(fwd, index, layer.self_attn, x, rotary)  # [N, W, Hq * D]
    h, x = ops.add_norm(fwd, ops.linear(fwd, attended, layer.self_attn.o_proj), h, layer.post_attention_layernorm)
    return h, ops.linear(fwd, ops.gated(fwd, x, layer.mlp), layer.mlp.down_proj)


def stack(ops: Ops, fwd: Forward, layers: nn.ModuleList, final_norm: RMSNorm, rotary: Rotary, h: Tensor
          ) -> tuple[Tensor, Tensor | None]:
    """h [N, W, H] through decoder layers and the final norm -> (normed [N, W, H], the layers
    fwd.taps names, their outputs side by side [N, W, len(taps) * H], or None)."""
    taps, pending = Taps(fwd, h, ops.in_place_taps), None
    for i, layer in enumerate(layers):
        h, x = ops.add_norm(fwd, pending, h, layer.input_layernorm, out=taps.out(i - 1))
        taps.keep(i - 1, h)
        if i == taps.done:
            taps.finish()
        h, pending = decoder_layer(ops, fwd, i, layer, rotary, h, x)
    h, x = ops.add_norm(fwd, pending, h, final_norm, out=taps.out(len(layers) - 1))
    taps.keep(len(layers) - 1, h)
    if taps.done == len(layers):
        taps.finish()
    return x, taps.result()


def init_random(module: nn.Module, seed: int, std: float, device: torch.device | str = "cpu") -> None:
    """Deterministic init: normal(std) for matrices, 1 ± 0.1 for norm weights, zero biases,
    drawn from a generator on ``device`` (the same seed gives other values on another kind)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = next(module.parameters()).dtype
    quantized = {f"{name}.weight": m for name, m in module.named_modules() if isinstance(m, Fp8Linear)}
    weights = dict(module.named_parameters()) | {name: m.weight for name, m in quantized.items()}
    with torch.no_grad():
        for name, p in sorted(weights.items()):
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * torch.randn(p.shape, generator=gen, device=device)
            elif name.endswith("bias"):
                values = torch.zeros(p.shape, device=device)
            else:
                values = std * torch.randn(p.shape, generator=gen, device=device)
            if name in quantized:  # the same draw as unquantized, rounded to the model's dtype, then by block
                fp8 = quantized[name]
                q, scale = quantize_weight(values.to(dtype), fp8.block)
                fp8.weight.copy_(q)
                fp8.weight_scale_inv.copy_(scale)
            else:
                p.copy_(values.to(p.dtype))
