"""The DFlash drafter (block diffusion, one non-causal forward per block).

A few Qwen3-style decoder layers with no embedding and no LM head of their own: the block is
embedded and read out by the target's. Target hidden states from ``target_layer_ids`` are
concatenated, projected by ``fc`` and RMS-normed (``hidden_norm``); every layer projects that
fused context with its own k/v projections (k-norm, RoPE at true positions) and places it in
front of the block's keys and values. Queries come only from the block.
"""

from __future__ import annotations

import torch
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
        vd = cfg.draft_vocab_size
        if vd is not None:  # a reduced vocabulary: its own read-out, mapped to target ids by d2t
            self.lm_head = nn.Linear(lc.hidden_size, vd, bias=False)
            self.register_buffer("d2t", torch.zeros(vd, dtype=torch.int64))  # [Vd] offsets
            self.register_buffer("t2d", torch.zeros(lc.vocab_size, dtype=torch.bool))  # [V] in the draft vocab

    def head(self, target) -> nn.Linear:
        """The read-out over the drafter's vocabulary: its own lm_head, else the target's."""
        return self.lm_head if self.config.draft_vocab_size is not None else target.lm_head

    def to_target_ids(self, best: Tensor) -> Tensor:
        """Draft-vocabulary ids [...] (head()'s argmax) -> target ids."""
        return best if self.config.draft_vocab_size is None else best + self.d2t[best]

    def logits(self, hidden: Tensor, target) -> Tensor:
        """Final-normed hidden [..., H] -> float32 logits over the target vocabulary [..., V]
        (a reduced vocabulary's at their target ids, -inf elsewhere: never drafted)."""
        if self.config.draft_vocab_size is None:
            return target.logits(hidden)
        small = self.lm_head(hidden).float()
        full = small.new_full((*small.shape[:-1], self.config.layers.vocab_size), float("-inf"))
        ids = torch.arange(small.shape[-1], device=small.device) + self.d2t
        return full.index_copy_(-1, ids, small)

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
