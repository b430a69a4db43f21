"""The frozen-KV multi-token-prediction drafter (Gemma-4 style).

Each chain step reads concat(embed(token) * sqrt(H), previous hidden) through
``pre_projection`` into the drafter's width, then a small stack of decoder layers whose
attention is query-only: keys and values come from the target's KV cache of its last layer
(the layer type every shipped target has), over the row's verified positions, and nothing is
written. Queries sit at one fixed position for the whole chain. ``post_projection`` maps back
to the target's width: that vector is the next step's previous hidden, and the logits are its
product with the target's embedding matrix (tied). The first step's previous hidden is the
target's last-layer output at the last verified position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from .checkpoint import load_weights
from .config import ConfigError, ModelConfig, model_config, read_config_json
from .dialect import MTP_DIALECT, layer_values
from .eager import EAGER
from .layers import MLP, RMSNorm, Rotary, decoder_layer
from .ops import Forward, Ops
from .presets import lookup_preset

ARCHITECTURE = "Gemma4MTPDrafter"

# reads the target's cached keys for one drafter layer: q [N, Hq, T, D] (rotated) -> [N, Hq, T, D]
KVReader = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class MTPConfig:
    layers: ModelConfig  # the drafter's stack (its num_kv_heads and head_dim are the target's)
    target_hidden_size: int


def mtp_config(raw: dict[str, Any]) -> MTPConfig:
    if ARCHITECTURE not in (raw.get("architectures") or []):
        raise ConfigError(f"architectures {raw.get('architectures')} is not a frozen-KV MTP drafter; "
                          f"expected ['{ARCHITECTURE}']")
    MTP_DIALECT.check_keys(raw)
    layer_values(raw)
    layers = replace(model_config(raw, default_arch="llama"), arch="qwen3" if raw.get("qk_norm") else "llama")
    return MTPConfig(layers=layers, target_hidden_size=int(raw.get("target_hidden_size") or layers.hidden_size))


class QueryOnlyAttention(nn.Module):
    """Query projections (and a per-head q norm) only: the keys are another model's."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class MTPLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = QueryOnlyAttention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Gemma4MTPModel(nn.Module):
    def __init__(self, cfg: MTPConfig):
        super().__init__()
        lc = cfg.layers
        self.config = cfg
        self.pre_projection = nn.Linear(2 * cfg.target_hidden_size, lc.hidden_size, bias=False)
        self.layers = nn.ModuleList(MTPLayer(lc) for _ in range(lc.num_layers))
        self.norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.post_projection = nn.Linear(lc.hidden_size, cfg.target_hidden_size, bias=False)
        self.rotary = Rotary(lc.rope, lc.head_dim)

    @property
    def scale(self) -> float:
        """What the token's embedding row is multiplied by."""
        return math.sqrt(self.config.target_hidden_size)

    def run(self, ops: Ops, fwd: Forward, embedding: Tensor, tokens: Tensor, hidden: Tensor) -> Tensor:
        """One chain step: tokens [N, W] (rows of ``embedding``, the target's [V, H]), the previous
        hidden [N, W, H], queries at fwd.positions over the target keys fwd.kv reads -> the next
        hidden [N, W, H] (post_projection)."""
        return self._layers(ops, fwd, ops.embed_beside(embedding, tokens, self.scale, hidden))

    def step(self, embeds: Tensor, hidden: Tensor, positions: Tensor, read: KVReader) -> Tensor:
        """run() in eager PyTorch from the tokens' embeddings [B, T, H] (unscaled; training),
        reading the target's keys through ``read`` -> the next hidden [B, T, H]."""
        inputs = torch.cat([embeds * self.scale, hidden], dim=-1)
        return self._layers(EAGER, Forward(positions, lambda layer, q, k, v: read(q)), inputs)

    def _layers(self, ops: Ops, fwd: Forward, inputs: Tensor) -> Tensor:
        """pre_projection of the step's input [N, W, 2H], the query-only layers, the final norm and
        post_projection; each layer's closing add+norm is the next one's input norm."""
        closing = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        h, x = ops.add_norm(fwd, ops.linear(fwd, inputs, self.pre_projection), None, self.layers[0].input_layernorm)
        for i, layer in enumerate(self.layers):
            h, pending = decoder_layer(ops, fwd, i, layer, self.rotary, h, x)
            h, x = ops.add_norm(fwd, pending, h, closing[i])
        return ops.project(x, self.post_projection)

    @staticmethod
    def logits(hidden: Tensor, embedding: Tensor) -> Tensor:
        """hidden [..., H] -> float32 logits [..., V] through the (tied) embedding matrix [V, H]."""
        return (hidden @ embedding.T).float()


def load_mtp(folder: str | Path) -> Gemma4MTPModel:
    model = Gemma4MTPModel(mtp_config(read_config_json(folder)))
    MTP_DIALECT.check_tensors(load_weights(model, folder), folder)
    return model.eval()


# Random-init shapes, as config.json dictionaries.
PRESETS: dict[str, dict[str, Any]] = {
    # for the tiny-qwen3 / tiny-llama random targets (width 128, 2 KV heads of 32)
    "tiny-mtp": {
        "architectures": [ARCHITECTURE], "vocab_size": 384, "hidden_size": 96, "intermediate_size": 192,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "target_hidden_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "initializer_range": 0.1,
    },
    # for CI's micro target (width 32, 1 KV head of 16)
    "micro-mtp": {
        "architectures": [ARCHITECTURE], "vocab_size": 4096, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "target_hidden_size": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "initializer_range": 0.02,
    },
    # for the shipped tiny-code target (width 256, 4 KV heads of 32)
    "tiny-code-mtp": {
        "architectures": [ARCHITECTURE], "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 768,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
        "target_hidden_size": 256, "qk_norm": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "initializer_range": 0.02,
    },
    # for the Qwen3-8B-shaped target (8 KV heads of 128), half its width: GPU benchmarks
    "qwen3-8b-mtp": {
        "architectures": [ARCHITECTURE], "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "target_hidden_size": 4096, "qk_norm": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "initializer_range": 0.02,
    },
}


def preset_config(name: str) -> MTPConfig:
    return mtp_config(lookup_preset(PRESETS, name, "gemma4_mtp"))


def random_mtp(preset: str, seed: int, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> Gemma4MTPModel:
    from .loader import _materialize

    cfg = preset_config(preset)
    return _materialize(lambda: Gemma4MTPModel(cfg), seed, cfg.layers.initializer_range, torch.device(device), dtype)
