"""Decoder building blocks shared by the target family and the drafters.

Attention takes an explicit ``attn`` callable supplied by the backend: it receives the
layer index and this step's rotated q, k, v and returns the attended values. The backend
owns the KV layout, the mask and whatever is cached; the modules hold no state.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig, RopeConfig


class AttentionFn(Protocol):
    """A backend's attention for one forward. It may also offer ``decoder_stack(layers,
    final_norm, rotary, h, positions, taps) -> (normed hidden, taps or None)`` to run a whole
    stack of DecoderLayers its own way (fused kernels); models built from DecoderLayers use it
    when present (see run_layers). Likewise ``norm(x, rmsnorm_module)`` and ``decoder_layer(
    layer, residual, x, positions, rotary, index, final_norm) -> (out, final_norm(out))`` for
    one decoder-shaped layer from its normed input (an EAGLE-3 head: see Eagle3DraftModel)."""

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [B, Hq, T, D], k/v [B, Hkv, T, D] -> out [B, Hq, T, D]"""
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
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def _heads(self, x: Tensor, n: int) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)  # [B, n, T, D]

    def project_kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, T, H] -> rotated k, v [B, Hkv, T, D]."""
        k = self._heads(self.k_proj(x), self.num_kv_heads)
        if hasattr(self, "k_norm"):
            k = self.k_norm(k)
        return rotate(k, cos, sin), self._heads(self.v_proj(x), self.num_kv_heads)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int, attn: AttentionFn) -> Tensor:
        q = self._heads(self.q_proj(x), self.num_heads)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q)
        k, v = self.project_kv(x, cos, sin)
        out = attn(layer, rotate(q, cos, sin), k, v)  # [B, Hq, T, D]
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, layer: int, attn: AttentionFn) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, layer, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


def run_layers(layers: nn.ModuleList, final_norm: RMSNorm, rotary: Rotary, h: Tensor, positions: Tensor,
               attn: AttentionFn, taps: tuple[int, ...] = ()) -> tuple[Tensor, Tensor | None]:
    """h [B, T, H] through the layers and the final norm -> (normed [B, T, H], the tapped
    layers' outputs concatenated [B, T, len(taps)*H] or None; tap -1 is h itself)."""
    stack = getattr(attn, "decoder_stack", None)
    if stack is not None:
        return stack(layers, final_norm, rotary, h, positions, taps)
    cos, sin = rotary(positions, h.dtype)
    tapped: dict[int, Tensor] = {-1: h} if -1 in taps else {}  # -1: the embedding output (layer 0's input)
    for i, layer in enumerate(layers):
        h = layer(h, cos, sin, i, attn)
        if i in taps:
            tapped[i] = h
    features = torch.cat([tapped[i] for i in taps], dim=-1) if taps else None
    return final_norm(h), features


def init_random(module: nn.Module, seed: int, std: float, device: torch.device | str = "cpu") -> None:
    """Deterministic init: normal(std) for matrices, 1 ± 0.1 for norm weights, zero biases,
    drawn from a generator on ``device`` (the same seed gives other values on another kind)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * torch.randn(p.shape, generator=gen, device=device)
            elif name.endswith("bias"):
                values = torch.zeros(p.shape, device=device)
            else:
                values = std * torch.randn(p.shape, generator=gen, device=device)
            p.copy_(values.to(p.dtype))
