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
from .eager import EAGER
from .layers import AttentionFn, DecoderLayer, RMSNorm, Rotary, stack
from .ops import Forward, Ops


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

    def logits(self, hidden: Tensor, target, ops: Ops = EAGER) -> Tensor:
        """Final-normed hidden [..., H] -> float32 logits over the target vocabulary [..., V]
        (a reduced vocabulary's at their target ids, -inf elsewhere: never drafted)."""
        small = ops.logits(self.head(target), hidden)
        if self.config.draft_vocab_size is None:
            return small
        full = small.new_full((*small.shape[:-1], self.config.layers.vocab_size), float("-inf"))
        ids = torch.arange(small.shape[-1], device=small.device) + self.d2t
        return full.index_copy_(-1, ids, small)

    def store_context(self, ops: Ops, fwd: Forward, features: Tensor) -> None:
        """Target features [N, C, n*H] at fwd.positions -> every layer's context keys and values
        (its k/v projections of hidden_norm(fc(features)): k-norm, RoPE), stored as fwd.kv says."""
        fused = ops.norm(fwd, ops.linear(fwd, features, self.fc), self.hidden_norm)  # [N, C, H]
        for i, layer in enumerate(self.layers):
            ops.store_kv(fwd, i, layer.self_attn, fused, self.rotary)

    def run(self, ops: Ops, fwd: Forward, block_embeds: Tensor) -> Tensor:
        """Block embeddings [N, B, H] at fwd.positions -> final-normed hidden [N, B, H]. fwd.kv
        attends each block query over the cached context followed by the whole block (no causal
        mask; a sliding layer as the checkpoint says), and keeps none of the block's keys for
        later forwards."""
        return stack(ops, fwd, self.layers, self.norm, self.rotary, block_embeds)[0]

    def context_kv(self, features: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Target features [B, C, n*H] at positions [B, C] -> per layer (k, v) [B, Hkv, C, D]
        (store_context in eager PyTorch, for training and checks)."""
        kept = _Kept()
        self.store_context(EAGER, Forward(positions, kept), features)
        return kept.kv

    def forward(self, block_embeds: Tensor, positions: Tensor, attn: AttentionFn) -> Tensor:
        """run() in eager PyTorch, attending through ``attn`` (training)."""
        return self.run(EAGER, Forward(positions, attn), block_embeds)


class _Kept:
    """An eager forward's kv that keeps what store_kv hands it, layer by layer."""

    def __init__(self):
        self.kv: list[tuple[Tensor, Tensor]] = []

    def append(self, layer: int, k: Tensor, v: Tensor) -> None:
        self.kv.append((k, v))
