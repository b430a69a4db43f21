"""The EAGLE-3 drafter: one decoder layer fed with fused target features, drafting a chain.

Target hidden states entering a few target layers (by default 2, N/2 and N-3) are
concatenated and projected by ``fc`` to the drafter's width. The single layer ("midlayer")
takes concat(input_norm(embed(token)), hidden_norm(h)) as its attention input (2H wide), with
h as the residual; then the MLP, the final norm and an LM head over a reduced draft
vocabulary, mapped to target ids by ``d2t`` (target id = draft id + d2t[draft id]). A chain
step feeds the layer's pre-norm output back as the next step's h, without ``fc``. The
drafter keeps its own one-layer KV cache; it has no embedding of its own (the target's).

Two checkpoint dialects are read: EAGLE / SpecForge (``LlamaForCausalLMEagle3``; weights
``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``) and the ``speculators``
wrapper (``speculators_model_type: eagle3``, the layer's fields under
``transformer_layer_config``, its weights under ``layers.0.*``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from .checkpoint import CheckpointError, load_weights, tensor_files
from .config import ConfigError, ModelConfig, model_config, read_config_json
from .layers import MLP, Attention, AttentionFn, RMSNorm, Rotary
from .presets import lookup_preset


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the one decoder layer (vocab_size: the target's)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # target layers whose *input* is tapped; None: (2, N/2, N-3)
    norm_before_residual: bool = False  # speculators option (its own default): the residual is the normed h
    dialect: str = "eagle"  # "eagle" (EAGLE / SpecForge) or "speculators"

    @property
    def num_aux(self) -> int:
        return 3 if self.aux_layer_ids is None else len(self.aux_layer_ids)


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    return (2, num_target_layers // 2, num_target_layers - 3)


def eagle3_config(raw: dict[str, Any]) -> Eagle3Config:
    """Either dialect's config.json -> Eagle3Config (ConfigError naming what is wrong)."""
    if raw.get("speculators_model_type") is not None:
        return _speculators(raw)
    if "LlamaForCausalLMEagle3" not in (raw.get("architectures") or []):
        raise ConfigError(
            f"architectures {raw.get('architectures')} is not an EAGLE-3 drafter; expected "
            "['LlamaForCausalLMEagle3'] (EAGLE / SpecForge) or a speculators config with "
            "speculators_model_type: eagle3")
    layer = replace(model_config({**raw, "num_hidden_layers": 1}, default_arch="llama"), arch="llama")
    # SpecForge's eagle_config ids name layers whose *output* is tapped: the input of the next one
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return Eagle3Config(layer=layer, draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
                        target_hidden_size=int(raw.get("target_hidden_size") or layer.hidden_size),
                        aux_layer_ids=None if ids is None else tuple(int(i) + 1 for i in ids))


def _speculators(raw: dict[str, Any]) -> Eagle3Config:
    if raw["speculators_model_type"] != "eagle3":
        raise ConfigError(f"speculators_model_type {raw['speculators_model_type']!r} is not eagle3")
    inner = raw.get("transformer_layer_config")
    if not isinstance(inner, dict):
        raise ConfigError("speculators config lacks transformer_layer_config (the draft layer's Llama fields)")
    layer = replace(model_config({**inner, "num_hidden_layers": 1}, default_arch="llama"), arch="llama")
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    return Eagle3Config(layer=layer, draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
                        target_hidden_size=int(raw.get("target_hidden_size") or layer.hidden_size),
                        aux_layer_ids=None if ids is None else tuple(int(i) for i in ids),
                        norm_before_residual=bool(raw.get("norm_before_residual", False)), dialect="speculators")


class Eagle3Layer(nn.Module):
    """A Llama decoder layer whose q/k/v read [normed embedding, normed hidden] (2H)."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.self_attn = Attention(cfg)
        a = self.self_attn
        a.q_proj = nn.Linear(2 * h, cfg.num_heads * d, bias=cfg.attention_bias)
        a.k_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        a.v_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, embeds: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, attn: AttentionFn) -> Tensor:
        """embeds, hidden [B, T, H] -> the layer's output [B, T, H] (pre-norm: fed back)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2H]
        h = residual + self.self_attn(x, cos, sin, 0, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3DraftModel(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        lc = cfg.layer
        self.config = cfg
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, lc.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(lc, cfg.norm_before_residual)
        self.norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.lm_head = nn.Linear(lc.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))  # [Vd] offsets
        self.register_buffer("t2d", torch.zeros(lc.vocab_size, dtype=torch.bool))  # [V] in the draft vocab
        self.rotary = Rotary(lc.rope, lc.head_dim)

    def step(self, embeds: Tensor, hidden: Tensor, positions: Tensor, attn: AttentionFn) -> Tensor:
        """One drafter forward: embeds [B, T, H] of the next tokens, hidden [B, T, H] (fc of the
        target features, or the previous step's output) at positions [B, T] -> output [B, T, H]."""
        if getattr(attn, "decoder_layer", None) is not None:
            return self.step_normed(embeds, hidden, positions, attn)[0]
        cos, sin = self.rotary(positions, embeds.dtype)
        return self.midlayer(embeds, hidden, cos, sin, attn)

    def step_normed(self, embeds: Tensor, hidden: Tensor, positions: Tensor, attn: AttentionFn
                    ) -> tuple[Tensor, Tensor]:
        """step() and the final norm of its output, (out, norm(out)) [B, T, H] each: the chain's
        next hidden and what its readout reads. Through the attention's fused forms where it
        offers them (``norm``, ``decoder_layer``: a backend's kernels, the same math)."""
        layer_fn = getattr(attn, "decoder_layer", None)
        if layer_fn is None:
            out = self.step(embeds, hidden, positions, attn)
            return out, self.norm(out)
        m = self.midlayer
        normed = attn.norm(hidden, m.hidden_norm)
        x = torch.cat([attn.norm(embeds, m.input_layernorm), normed], dim=-1)  # [B, T, 2H]
        return layer_fn(m, normed if m.norm_before_residual else hidden, x, positions, self.rotary, 0, self.norm)

    def greedy(self, normed: Tensor, head_argmax) -> Tensor:
        """The greedy token over the target vocabulary from normed outputs [..., H]: the draft
        vocabulary's argmax mapped to its target id (``head_argmax`` may be a backend's readout
        that writes no logits). Equal to logits(out).argmax(-1) when draft ids are ascending
        (ties: the first in either order): check ascending_ids() first."""
        best = head_argmax(self.lm_head, normed)  # [...] draft-vocabulary index
        return best + self.d2t[best]

    def ascending_ids(self) -> bool:
        ids = self.draft_ids()
        return bool((ids[1:] > ids[:-1]).all())

    def logits(self, out: Tensor) -> Tensor:
        """Layer output [..., H] -> float32 logits over the *target* vocabulary [..., V]: the
        draft vocabulary's logits at their target ids, -inf elsewhere (never drafted)."""
        small = self.lm_head(self.norm(out)).float()  # [..., Vd]
        full = small.new_full((*small.shape[:-1], self.config.layer.vocab_size), float("-inf"))
        ids = torch.arange(small.shape[-1], device=small.device) + self.d2t
        return full.index_copy_(-1, ids, small)

    def draft_ids(self) -> Tensor:
        """[Vd] target id of each draft-vocabulary entry."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t


def _names(model: Eagle3DraftModel) -> dict[str, str]:
    """Module parameter name -> checkpoint tensor name for the model's dialect."""
    if model.config.dialect == "speculators":
        return {n: n.replace("midlayer.", "layers.0.", 1) for n, _ in model.named_parameters()}
    return {n: n for n, _ in model.named_parameters()}


def load_eagle3(folder: str | Path) -> Eagle3DraftModel:
    model = Eagle3DraftModel(eagle3_config(read_config_json(folder)))
    load_weights(model, folder, names=_names(model))
    files = tensor_files(folder)
    for name in ("d2t", "t2d"):
        buf = getattr(model, name)
        if name not in files:
            if model.config.draft_vocab_size == model.config.layer.vocab_size:
                if name == "t2d":
                    buf.fill_(True)  # the full vocabulary: identity mapping
                continue
            raise CheckpointError(f"{folder}: missing tensor {name} (the draft vocabulary's mapping to target ids)")
        with safe_open(files[name], framework="pt") as f:
            tensor = f.get_tensor(name)
        if tuple(tensor.shape) != tuple(buf.shape):
            raise CheckpointError(f"{folder}: {name} has shape {list(tensor.shape)}, expected {list(buf.shape)} "
                                  "(draft_vocab_size and vocab_size in config.json)")
        buf.copy_(tensor.to(buf.dtype))
    return model.eval()


# Random-init shapes, as config.json dictionaries (either dialect parses the same way).
PRESETS: dict[str, dict[str, Any]] = {
    # for the tiny-qwen3 / tiny-llama random targets (6 layers, width 128, byte vocabulary)
    "tiny-eagle3": {
        "architectures": ["LlamaForCausalLMEagle3"], "vocab_size": 384, "draft_vocab_size": 256,
        "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "initializer_range": 0.1,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 3]},  # outputs: the inputs of 1, 3, 4
    },
    # for CI's micro target (2 layers, width 32): every tap is layer 1's input
    "micro-eagle3": {
        "architectures": ["LlamaForCausalLMEagle3"], "vocab_size": 4096, "hidden_size": 32,
        "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "initializer_range": 0.02,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 0, 0]},
    },
    # for the shipped tiny-code target (8 layers, width 256, 4096-token BPE vocabulary)
    "tiny-code-eagle3": {
        "architectures": ["LlamaForCausalLMEagle3"], "vocab_size": 4096, "draft_vocab_size": 4096,
        "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "initializer_range": 0.02,
    },
    # the shape of SpecForge's Qwen3-8B heads (32K draft vocabulary), for GPU benchmarks
    "qwen3-8b-eagle3": {
        "architectures": ["LlamaForCausalLMEagle3"], "vocab_size": 151936, "draft_vocab_size": 32000,
        "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "initializer_range": 0.02,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 17, 32]},  # outputs: the inputs of 2, 18, 33
    },
}


def preset_config(name: str) -> Eagle3Config:
    return eagle3_config(lookup_preset(PRESETS, name, "eagle3"))


def random_eagle3(preset: str, seed: int, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> Eagle3DraftModel:
    """Random weights; the draft vocabulary is the target's first draft_vocab_size ids."""
    from .loader import _materialize

    cfg = preset_config(preset)
    model = _materialize(lambda: Eagle3DraftModel(cfg), seed, cfg.layer.initializer_range, torch.device(device), dtype)
    with torch.no_grad():
        model.d2t.zero_()
        model.t2d.zero_()
        model.t2d[: cfg.draft_vocab_size] = True
    return model
