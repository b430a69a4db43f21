"""Model configurations parsed from HF-format ``config.json`` dictionaries.

Both rope layouts found in the wild load: top-level ``rope_theta`` / ``rope_scaling``
(published Qwen3 and Llama-3.1 checkpoints) and transformers 5's ``rope_parameters``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .fp8 import Fp8Scheme

ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
}
MODEL_TYPES = {"qwen3": "qwen3", "llama": "llama"}


class ConfigError(ValueError):
    """A config.json that cannot describe a model this engine runs."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """A decoder stack's shape; the target and the DFlash drafter share it."""

    arch: str  # "qwen3" | "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    eos_token_ids: tuple[int, ...] = ()
    initializer_range: float = 0.02
    fp8: "Fp8Scheme | None" = None  # block-scaled e4m3 decoder projections (quantization_config); None: bf16

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"


@dataclass(frozen=True)
class DFlashConfig:
    """The DFlash drafter: a Qwen3-style layer stack plus block-diffusion fields."""

    layers: ModelConfig
    block_size: int
    mask_token_id: int | None
    target_layer_ids: tuple[int, ...]  # target layers whose *output* is tapped (-1: the embedding output)
    num_target_layers: int | None  # the target trained against (None: the checkpoint does not say)
    dialect: str = "z-lab DFlash"
    layer_windows: tuple[int | None, ...] = ()  # per layer: its sliding window, None (or no entry): full
    sliding_block_causal: bool = True  # a sliding layer's block is causal (speculators' default)
    # a sliding layer's query sees the window ending at itself, causally (z-lab); else the last
    # `window` context positions before the block, then the block (speculators)
    sliding_per_query: bool = False
    draft_vocab_size: int | None = None  # its own lm_head over this many ids, mapped by d2t (None: the target's)

    def windows(self) -> dict[int, int]:
        """layer -> sliding window, for the layers that slide."""
        return {i: w for i, w in enumerate(self.layer_windows) if w is not None}


def default_dflash_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Evenly spaced from layer 1 to N-3 (one per draft layer), as the published drafters."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    span = end - start
    return tuple(int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


def read_config_json(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: file not found; an HF-format checkpoint folder holds config.json "
                          "beside its model.safetensors: give the path of one")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc


def _rope(raw: dict[str, Any]) -> RopeConfig:
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind not in ("default", "linear", "llama3"):
        raise ConfigError(f"rope type {kind!r} is not supported; supported: default, linear, llama3")
    return RopeConfig(
        theta=float(theta),
        kind=kind,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position=int(merged.get("original_max_position_embeddings", 8192)),
    )


def _arch(raw: dict[str, Any], default: str | None) -> str:
    for name in raw.get("architectures") or []:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if raw.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[raw["model_type"]]
    if default:
        return default
    known = ", ".join(ARCHITECTURES)
    raise ConfigError(f"architectures {raw.get('architectures')} not supported; supported: {known}")


def _eos(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _number(raw: dict[str, Any], key: str, kind: type, default: Any = None) -> Any:
    """``raw[key]`` as ``kind`` (``default`` where it is absent or null), or a ConfigError naming the field."""
    value = raw.get(key)
    if value is None:
        if default is None:
            raise ConfigError(f"config.json lacks the field {key!r}")
        return default
    try:
        if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ConfigError(f"config.json: `{key}` is {shown}, not {'an integer' if kind is int else 'a number'}; "
                          "fix it in the checkpoint's config.json") from None


def model_config(raw: dict[str, Any], default_arch: str | None = None, quantized: bool = False) -> ModelConfig:
    """A layer stack's config; ``quantized``: a target's, which may be an fp8 checkpoint
    (drafters load bf16 only)."""
    hidden, heads = _number(raw, "hidden_size", int), _number(raw, "num_attention_heads", int)
    return ModelConfig(
        arch=_arch(raw, default_arch),
        vocab_size=_number(raw, "vocab_size", int),
        hidden_size=hidden,
        intermediate_size=_number(raw, "intermediate_size", int),
        num_layers=_number(raw, "num_hidden_layers", int),
        num_heads=heads,
        num_kv_heads=_number(raw, "num_key_value_heads", int, heads) or heads,
        head_dim=_number(raw, "head_dim", int, hidden // heads if heads else 0) or hidden // heads,
        rms_norm_eps=_number(raw, "rms_norm_eps", float, 1e-6),
        rope=_rope(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        max_position_embeddings=_number(raw, "max_position_embeddings", int, 32768),
        eos_token_ids=_eos(raw),
        initializer_range=_number(raw, "initializer_range", float, 0.02),
        fp8=_quantization(raw, quantized),
    )


def _quantization(raw: dict[str, Any], quantized: bool) -> "Fp8Scheme | None":
    from .fp8 import fp8_scheme  # fp8.py reads this module's ConfigError

    if "quantization_config" in raw and not quantized:
        raise ConfigError("config.json quantization_config: a drafter loads in bf16 only (the target may be fp8); "
                          "use the drafter's bf16 checkpoint")
    scheme = fp8_scheme(raw.get("quantization_config"))
    if scheme is not None and raw.get("attention_bias"):
        raise ConfigError("config.json: attention_bias with quantization_config fp8: fp8 projections carry no bias")
    return scheme


def read_model_config(folder: str | Path) -> ModelConfig:
    """A checkpoint folder's target config; its errors name the file."""
    try:
        return model_config(read_config_json(folder), quantized=True)
    except ConfigError as exc:
        path = str(Path(folder) / "config.json")
        text = str(exc)
        raise ConfigError(text if text.startswith(path) else f"{path}: {text.removeprefix('config.json: ')}") from None


def dflash_config(raw: dict[str, Any]) -> DFlashConfig:
    from .dialect import DFLASH_DIALECT, DFLASH_FIELDS, layer_values  # dialect.py reads this module's ConfigError

    if raw.get("speculators_model_type") is not None:
        from .speculators_dflash import speculators_dflash_config

        return speculators_dflash_config(raw)
    if "DFlashDraftModel" not in (raw.get("architectures") or []):
        raise ConfigError(
            f"architectures {raw.get('architectures')} is not a DFlash drafter; "
            "expected ['DFlashDraftModel'] (the z-lab checkpoint dialect)"
        )
    DFLASH_DIALECT.check_keys(raw)
    windows = layer_values(raw, sliding_ok=True)
    extra = raw.get("dflash_config") or {}
    DFLASH_FIELDS.check_keys(extra, "config.json dflash_config")
    if raw.get("model_type", "qwen3") != "qwen3":
        raise ConfigError(f"config.json: model_type {raw['model_type']!r}; DFlash drafters (z-lab dialect) are "
                          "Qwen3-style layers with q/k norms (model_type: qwen3)")
    layers = replace(model_config(raw, default_arch="qwen3"), arch="qwen3")
    if "num_target_layers" not in raw:
        raise ConfigError("config.json lacks the field 'num_target_layers'")
    n_target = int(raw["num_target_layers"])
    ids = extra.get("target_layer_ids") or default_dflash_layer_ids(n_target, layers.num_layers)
    mask = extra.get("mask_token_id")
    return DFlashConfig(
        layers=layers,
        block_size=int(raw.get("block_size", 16)),
        mask_token_id=None if mask is None else int(mask),
        target_layer_ids=tuple(int(i) for i in ids),
        num_target_layers=n_target,
        # z-lab's sliding layers are causal, each query over the `window` keys ending at itself
        layer_windows=windows,
        sliding_per_query=True,
    )
