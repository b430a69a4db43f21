"""The DFlash drafter (block diffusion, one non-causal forward per block).

A few Qwen3-style decoder layers with no embedding and no LM head of their own: the block is
embedded and read out by the target's. Target hidden states from ``target_layer_ids`` are
concatenated, projected by ``fc`` and RMS-normed (``hidden_norm``); every layer projects that
fused context with its own k/v projections (k-norm, RoPE at true positions) and places it in
front of the block's keys and values. Queries come only from the block.
"""

from __future__ import annotations

from torch import Tensor, nn

from .config import DFlashConfig
from .layers import AttentionFn, DecoderLayer, RMSNorm, Rotary, run_layers


class DFlashDraftModel(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        lc = cfg.layers
        self.config = cfg
        self.layers = nn.ModuleList(DecoderLayer(lc) for _ in range(lc.num_layers))
        self.fc = nn.Linear(len(cfg.target_layer_ids) * lc.hidden_size, lc.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.rotary = Rotary(lc.rope, lc.head_dim)

    def fuse(self, features: Tensor) -> Tensor:
        """Target features [B, C, n*H] -> the fused context [B, C, H] every layer projects."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, features: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Target features [B, C, n*H] at positions [B, C] -> per layer (k, v) [B, Hkv, C, D]."""
        fused = self.fuse(features)
        cos, sin = self.rotary(positions, fused.dtype)
        return [layer.self_attn.project_kv(fused, cos, sin) for layer in self.layers]

    def forward(self, block_embeds: Tensor, positions: Tensor, attn: AttentionFn) -> Tensor:
        """Block embeddings [B, T, H] at positions [B, T] -> final-normed hidden [B, T, H].

        ``attn`` must attend each block query over the cached context K/V followed by the
        block's own K/V, without a causal mask, and must not keep the block's K/V.
        """
        return run_layers(self.layers, self.norm, self.rotary, block_embeds, positions, attn)[0]
