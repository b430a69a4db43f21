"""DFlash drafters in the ``speculators`` format (``speculators_model_type: dflash``).

The same block-diffusion drafter as the z-lab dialect (layer weights, ``fc``, ``hidden_norm``,
``norm`` under the same names), described otherwise: the layer fields under
``transformer_layer_config`` (its layers are Qwen3-style, with q/k norms, whatever target family
the fields came from), ``aux_hidden_state_layer_ids`` naming target layers whose *input* is
tapped (vLLM's capture convention: id i is the output of layer i - 1, id 0 the embedding
output), ``mask_token_id`` and ``block_size`` at the top level. A full-vocabulary drafter stores
no embedding or read-out: both are the target's, as in draftline's DFlash.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .config import ConfigError, DFlashConfig, model_config
from .dialect import SPECULATORS_INERT, Dialect, layer_dialect, layer_values, speculators_runtime

SPECULATORS_DFLASH = Dialect(
    "speculators DFlash",
    read=frozenset({"speculators_model_type", "architectures", "transformer_layer_config", "draft_vocab_size",
                    "block_size", "target_hidden_size", "aux_hidden_state_layer_ids", "mask_token_id",
                    "sample_from_anchor", "sliding_window_non_causal", "speculators_config"}),
    inert={
        **SPECULATORS_INERT,
        "tie_word_embeddings": "a full-vocabulary drafter reads out through the target's lm_head",
    },
    inert_tensors={
        "embed_tokens.weight": "speculators replaces it with the target's embedding on load",
        "lm_head.weight": "a full-vocabulary drafter's read-out is replaced by the target's lm_head on load "
                          "(a reduced vocabulary's is loaded)",
    },
)
SPECULATORS_DFLASH_LAYER = layer_dialect("speculators DFlash (transformer_layer_config)")
SPECULATORS_DFLASH_RUNTIME = speculators_runtime("speculators DFlash")


def speculators_dflash_config(raw: dict[str, Any]) -> DFlashConfig:
    kind = raw["speculators_model_type"]
    if kind != "dflash":
        use = " (an EAGLE-3 head: use method: eagle3)" if kind == "eagle3" else ""
        raise ConfigError(f"speculators_model_type {kind!r} is not a DFlash drafter{use}; expected dflash")
    SPECULATORS_DFLASH.check_keys(raw)
    runtime = raw.get("speculators_config") or {}
    SPECULATORS_DFLASH_RUNTIME.check_keys(runtime, "config.json speculators_config")
    if runtime.get("algorithm", "dflash") != "dflash":
        raise ConfigError(f"config.json speculators_config.algorithm {runtime['algorithm']!r} is not dflash "
                          "(dflash2 and dspark draft differently)")
    inner = raw.get("transformer_layer_config")
    if not isinstance(inner, dict):
        raise ConfigError("speculators config lacks transformer_layer_config (the draft layers' fields)")
    where = "config.json transformer_layer_config"
    SPECULATORS_DFLASH_LAYER.check_keys(inner, where)
    windows = layer_values(inner, where, sliding_ok=True)
    layers = replace(model_config(inner, default_arch="qwen3"), arch="qwen3")  # always Qwen3-style layers
    _refuse_unsupported(raw, layers)
    ids = raw.get("aux_hidden_state_layer_ids")
    if not ids:
        raise ConfigError("config.json lacks aux_hidden_state_layer_ids (the target layers the drafter reads)")
    mask = raw.get("mask_token_id")
    return DFlashConfig(layers=layers, block_size=int(raw.get("block_size", 8)),
                        mask_token_id=None if mask is None else int(mask),
                        target_layer_ids=tuple(int(i) - 1 for i in ids),  # the input of layer i: layer i-1's output
                        num_target_layers=None, dialect="speculators DFlash", layer_windows=windows,
                        sliding_block_causal=not raw.get("sliding_window_non_causal", False),
                        draft_vocab_size=_draft_vocab(raw, layers))


def _draft_vocab(raw: dict[str, Any], layers) -> int | None:
    """A reduced vocabulary's size (its own lm_head, d2t and t2d in the checkpoint), else None."""
    vd = raw.get("draft_vocab_size")
    return None if vd is None or int(vd) == layers.vocab_size else int(vd)


def _refuse_unsupported(raw: dict[str, Any], layers) -> None:
    vd = raw.get("draft_vocab_size")
    if vd is not None and not 0 < int(vd) <= layers.vocab_size:
        raise ConfigError(f"config.json: draft_vocab_size {vd} is outside 1..vocab_size ({layers.vocab_size}); "
                          "d2t maps draft ids into the target vocabulary")
    if raw.get("sample_from_anchor"):
        raise ConfigError("config.json: sample_from_anchor: true (the anchor slot drafts too, block_size drafts a "
                          "round) is not supported; draftline's DFlash drafts block_size - 1 tokens after the anchor")
    hidden = raw.get("target_hidden_size")
    if hidden is not None and int(hidden) != layers.hidden_size:
        raise ConfigError(f"config.json: target_hidden_size {hidden} != hidden_size {layers.hidden_size}; "
                          "DFlash's fc reads target features of the drafter's own width")
