"""The target family: Qwen3 and Llama-3 decoders (HF parameter names), able to return the
hidden states output by chosen layers for the drafters that condition on them."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .config import ModelConfig
from .layers import AttentionFn, DecoderLayer, RMSNorm, Rotary, stack
from .eager import EAGER
from .ops import Forward, Ops


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TargetModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(cfg.rope, cfg.head_dim)

    def embed(self, ids: Tensor) -> Tensor:
        return self.model.embed_tokens.weight[ids]

    def run(self, ops: Ops, fwd: Forward, ids: Tensor) -> tuple[Tensor, Tensor | None]:
        """ids [N, W] at fwd.positions -> (final-normed hidden [N, W, H], the output hidden states
        of the layers fwd.taps names, side by side [N, W, len(taps)*H], or None)."""
        m = self.model
        return stack(ops, fwd, m.layers, m.norm, self.rotary, ops.embed(m.embed_tokens.weight, ids))

    def forward(
        self, ids: Tensor, positions: Tensor, attn: AttentionFn, taps: tuple[int, ...] = ()
    ) -> tuple[Tensor, Tensor | None]:
        """run() in eager PyTorch (training, uncached scoring), attending through ``attn``."""
        return self.run(EAGER, Forward(positions, attn, taps), ids)

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> float32 logits [..., V]."""
        return self.lm_head(hidden).float()
