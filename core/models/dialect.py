"""No silent fields: every ``config.json`` key and every checkpoint tensor of a drafter is
either read, on an explicit list of names known to have no effect on inference (each with
the reason), or refused with an error that names it and says what to do.

A checkpoint dialect (z-lab DFlash, EAGLE / SpecForge EAGLE-3, speculators EAGLE-3, the
frozen-KV MTP drafter) lists the keys its loader reads and the keys it may ignore; anything
else means the checkpoint was written by a format this engine does not know in full, and
running it anyway could draft from a different function than the one trained, without a word.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from .config import ConfigError

# Keys of a Llama / Qwen3 layer config that model_config() reads.
LAYER_KEYS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "attention_bias", "max_position_embeddings", "architectures", "model_type",
    "hidden_act", "mlp_bias", "layer_types", "use_sliding_window", "sliding_window",  # checked by layer_values()
})

# Keys of an HF layer config that change nothing a drafter computes at inference.
LAYER_INERT = {
    "torch_dtype": "the spec's dtype decides the weights' dtype",
    "dtype": "the spec's dtype decides the weights' dtype",
    "transformers_version": "provenance only",
    "_name_or_path": "provenance only",
    "bos_token_id": "a tokenizer fact; the drafter never emits or stops on it",
    "eos_token_id": "stop tokens are the target's, not the drafter's",
    "pad_token_id": "no padding token is embedded at inference",
    "use_cache": "the backend decides caching",
    "attention_dropout": "dropout is off at inference",
    "initializer_range": "random initialization only (draftline uses it for random_init presets)",
    "pretraining_tp": "a training-time split of the same matmuls",
    "tie_word_embeddings": "a drafter's read-out weights are loaded by name (or are the target's)",
    "max_window_layers": "derives layer_types only where a config lacks them (use_sliding_window then is refused)",
    "auto_map": "names remote-code classes; the weights and keys here define the model",
    "output_attentions": "debug output only",
    "output_hidden_states": "debug output only",
    "return_dict": "debug output only",
}

ROPE_KEYS = frozenset({"rope_theta", "rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings"})


@dataclass(frozen=True)
class Dialect:
    """One checkpoint format's config keys and tensor names."""

    name: str  # as error messages and `draftline explain` say it
    read: frozenset[str]  # keys the loader reads (their values are checked where read)
    inert: dict[str, str] = field(default_factory=dict)  # key -> why it has no effect on inference
    inert_tensors: dict[str, str] = field(default_factory=dict)  # tensor name -> why it is not loaded

    def check_keys(self, raw: dict[str, Any], where: str = "config.json") -> None:
        """Raise ConfigError naming the first key this dialect neither reads nor may ignore."""
        unknown = sorted(set(raw) - self.read - set(self.inert))
        if unknown:
            raise ConfigError(
                f"{where}: key {unknown[0]!r} is not part of the {self.name} checkpoint dialect as draftline "
                f"reads it{_more(unknown)}; its effect on drafting is unknown, so the checkpoint is refused "
                "rather than run differently from how it was trained. Remove the key if it has no effect "
                "on inference, or use a drafter without it")

    def check_tensors(self, unused: Iterable[str], folder: Any) -> None:
        """Raise CheckpointError naming the first tensor neither loaded nor known to be inert."""
        from .checkpoint import CheckpointError

        unknown = sorted(set(unused) - set(self.inert_tensors))
        if unknown:
            raise CheckpointError(
                f"{folder}: tensor {unknown[0]!r} is not part of the {self.name} checkpoint dialect as draftline "
                f"reads it{_more(unknown)}; it would be ignored, and the drafter would compute something other "
                "than what was trained. Use a checkpoint of this dialect's layout, or remove the tensor if it "
                "has no effect on inference")


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more: {', '.join(names[1:4])}{' ...' if len(names) > 4 else ''})" \
        if len(names) > 1 else ""


def layer_dialect(name: str, extra_read: Iterable[str] = (), extra_inert: dict[str, str] | None = None) -> Dialect:
    return Dialect(name=name, read=LAYER_KEYS | frozenset(extra_read), inert={**LAYER_INERT, **(extra_inert or {})})


def layer_values(raw: dict[str, Any], where: str = "config.json", sliding_ok: bool = False
                 ) -> tuple[int | None, ...]:
    """Refuse layer-config values this engine's layers do not compute: another activation,
    MLP biases, sliding-window layers (unless ``sliding_ok``), rope keys it does not read.
    -> each layer's sliding window (None: full attention), as layer_types gives them, or ()."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act {act!r} is not supported (the gated MLP computes silu); "
                          "use a drafter with hidden_act: silu")
    if raw.get("mlp_bias"):
        raise ConfigError(f"{where}: mlp_bias: true is not supported (the MLP projections have no bias)")
    types = raw.get("layer_types") or []
    sliding = [i for i, t in enumerate(types) if t != "full_attention"]
    if sliding and not (sliding_ok and set(types) <= {"sliding_attention", "full_attention"}):
        kinds = sorted({types[i] for i in sliding})
        raise ConfigError(f"{where}: layer_types gives layer(s) {sliding} attention {kinds}; this drafter dialect "
                          "runs full attention only, so a sliding-window drafter would draft differently from "
                          "how it was trained. Use a drafter whose layer_types are all full_attention")
    if raw.get("use_sliding_window") and not types:  # with layer_types given, they decide (as in transformers)
        raise ConfigError(f"{where}: use_sliding_window: true without layer_types is not supported (which "
                          "layers slide is unknown); use a drafter whose config lists layer_types")
    window = raw.get("sliding_window") if sliding else None
    if sliding and (not isinstance(window, int) or window < 1):
        raise ConfigError(f"{where}: sliding_attention layers need a positive sliding_window, got {window!r}")
    if types and len(types) != int(raw.get("num_hidden_layers", len(types))):
        raise ConfigError(f"{where}: layer_types lists {len(types)} layers, num_hidden_layers is "
                          f"{raw.get('num_hidden_layers')}; give one type per layer")
    for key in ("rope_scaling", "rope_parameters"):
        unknown = sorted(set(raw.get(key) or {}) - ROPE_KEYS)
        if unknown:
            raise ConfigError(f"{where}: {key}.{unknown[0]} is not read by draftline's rotary embedding "
                              f"(it reads {', '.join(sorted(ROPE_KEYS))}); use a drafter without it")
    return tuple(window if t == "sliding_attention" else None for t in types)


# z-lab DFlash drafters (architectures: [DFlashDraftModel]): Qwen3 layer fields at the top level
DFLASH_DIALECT = layer_dialect("z-lab DFlash", extra_read=("block_size", "dflash_config", "num_target_layers"))
DFLASH_FIELDS = Dialect("z-lab DFlash (dflash_config)", read=frozenset({"mask_token_id", "target_layer_ids"}))

# the frozen-KV MTP drafter (architectures: [Gemma4MTPDrafter]), as draftline writes it
MTP_DIALECT = layer_dialect("frozen-KV MTP (Gemma4MTPDrafter)", extra_read=("qk_norm", "target_hidden_size"))


SPECULATORS_INERT = {  # keys of every speculators config.json that change no computation
    "speculators_version": "provenance only",
    "transformers_version": "provenance only",
    "dtype": "the spec's dtype decides the weights' dtype",
    "torch_dtype": "the spec's dtype decides the weights' dtype",
    "auto_map": "names speculators' config class; the keys here define the model",
}


def speculators_runtime(name: str) -> Dialect:
    """What speculators_config holds beside the algorithm: how speculators' own runtime proposes
    and verifies; draftline's spec decides K and its acceptance rule (lossless either way)."""
    return Dialect(f"{name} (speculators_config)", read=frozenset({"algorithm"}), inert={
        "proposal_methods": "speculators' runtime proposal settings; the spec's K or block size decides",
        "default_proposal_method": "speculators' runtime proposal settings; the spec decides",
        "verifier": "names the target trained against; the spec names the target, checked by shape",
    })
