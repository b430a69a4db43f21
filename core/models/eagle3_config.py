"""EAGLE-3 head configurations, from the three checkpoint dialects' ``config.json``.

EAGLE / SpecForge (``architectures: [LlamaForCausalLMEagle3]``): the draft layer's Llama fields
at the top level, ``eagle_config.eagle_aux_hidden_state_layer_ids`` naming target layers whose
*output* is tapped, SpecForge's ``fc_norm`` and ``norm_output`` (false: lm_head reads the
layer's output without the final norm). AngelSlim (``[Eagle3LlamaForCausalLM]``): the same fields and weights; its
heads tap the inputs of layers 2, N/2 and N-3 and the config names no ids. speculators
(``speculators_model_type: eagle3``): the draft layer's Llama or Qwen3 fields under
``transformer_layer_config``, ``eagle_aux_hidden_state_layer_ids`` naming layers whose *input*
is tapped (0: the embedding output), and the options that change the head's function
(``norm_before_fc``, ``fc_norm``, ``norm_output``: the normed output fed back,
``norm_before_residual``), more decoder layers after the first, and sliding-window layers
(``layer_types``). Every key is read, known to be inert, or refused (dialect.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .config import ConfigError, ModelConfig, model_config
from .dialect import SPECULATORS_INERT, Dialect, layer_dialect, layer_values, speculators_runtime


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the decoder layers (vocab_size: the target's; arch llama or qwen3: q/k norms)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # target layers whose *input* is tapped; None: (2, N/2, N-3)
    norm_before_residual: bool = False  # the layer's residual is hidden_norm(h), not h
    norm_before_fc: bool = False  # one RMSNorm (input_norm) over the concatenated features before fc
    fc_norm: bool = False  # one RMSNorm per tapped layer's features (fc_norm.i) before fc
    norm_output: bool = False  # a chain step feeds back norm(out), not out (speculators' norm_output)
    readout_norm: bool = True  # lm_head reads norm(out); False: out itself (SpecForge's norm_output: false)
    layer_windows: tuple[int | None, ...] = ()  # per layer: its sliding window, None (or no entry): full
    dialect: str = "eagle"  # "eagle" (EAGLE / SpecForge), "angelslim" or "speculators": a key of DIALECTS

    @property
    def num_aux(self) -> int:
        return 3 if self.aux_layer_ids is None else len(self.aux_layer_ids)

    def options(self) -> list[str]:
        """Every option that changes what the head computes, as `draftline explain` prints them."""
        out = [f"{self.layer.arch} layer" + (" (q/k norms)" if self.layer.qk_norm else "")]
        out.append("full vocabulary" if self.draft_vocab_size == self.layer.vocab_size
                   else f"draft vocabulary {self.draft_vocab_size} of {self.layer.vocab_size}")
        out += [name for name in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")
                if getattr(self, name)]
        if not self.readout_norm:
            out.append("no final norm before lm_head (norm_output: false)")
        if self.layer.num_layers > 1:
            out.append(f"{self.layer.num_layers} decoder layers (the first reads [embedding, hidden])")
        out += [f"layer {i}: sliding-window attention over {w} positions" for i, w in self.windows().items()]
        if self.aux_layer_ids is None:
            out.append("tapped layer inputs: the default (2, N/2, N-3)")
        else:
            out.append(f"tapped layer inputs {list(self.aux_layer_ids)}"
                       + (" (0: the embedding output)" if 0 in self.aux_layer_ids else ""))
        return out

    def windows(self) -> dict[int, int]:
        """layer -> sliding window, for the layers that slide."""
        return {i: w for i, w in enumerate(self.layer_windows) if w is not None}

    @property
    def dialect_name(self) -> str:
        return DIALECTS[self.dialect].name


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    return (2, num_target_layers // 2, num_target_layers - 3)


EAGLE_DIALECT = layer_dialect(
    "EAGLE / SpecForge EAGLE-3",
    extra_read=("draft_vocab_size", "target_hidden_size", "eagle_config", "norm_before_residual", "fc_norm",
                "norm_output"),
    extra_inert={"target_model_type": "names the target family trained against; the spec names the target, "
                                      "checked by shape"},
)
# AngelSlim (Tencent) heads: the EAGLE layout and tensor names under another architecture name;
# its targets tap the inputs of layers 2, N/2 and N-3 (draftline's default), and the config names none
ANGELSLIM_DIALECT = layer_dialect(
    "AngelSlim EAGLE-3", extra_read=("draft_vocab_size", "target_hidden_size"),
    extra_inert={"target_model_type": "names the target family trained against; the spec names the target, "
                                      "checked by shape"},
)
EAGLE_CONFIG_KEYS = Dialect("EAGLE / SpecForge EAGLE-3 (eagle_config)", read=frozenset({
    "eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state"}))

SPECULATORS_DIALECT = Dialect(
    "speculators EAGLE-3",
    read=frozenset({"speculators_model_type", "architectures", "transformer_layer_config", "draft_vocab_size",
                    "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_residual",
                    "norm_before_fc", "fc_norm", "norm_output", "speculators_config"}),
    inert={
        **SPECULATORS_INERT,
        "tie_word_embeddings": "the head's lm_head is its own tensor",
        "embed_requires_grad": "training only: a trained embed_tokens differs from the target's and is then used",
    },
)
SPECULATORS_LAYER = layer_dialect("speculators EAGLE-3 (transformer_layer_config)")
SPECULATORS_RUNTIME = speculators_runtime("speculators EAGLE-3")


def eagle3_config(raw: dict[str, Any]) -> Eagle3Config:
    """Either dialect's config.json -> Eagle3Config (ConfigError naming what is wrong)."""
    if raw.get("speculators_model_type") is not None:
        return _speculators(raw)
    if "Eagle3LlamaForCausalLM" in (raw.get("architectures") or []):
        return _angelslim(raw)
    if "LlamaForCausalLMEagle3" not in (raw.get("architectures") or []):
        raise ConfigError(
            f"architectures {raw.get('architectures')} is not an EAGLE-3 drafter; expected "
            "['LlamaForCausalLMEagle3'] (EAGLE / SpecForge), ['Eagle3LlamaForCausalLM'] (AngelSlim) or a "
            "speculators config with speculators_model_type: eagle3")
    EAGLE_DIALECT.check_keys(raw)
    eagle = raw.get("eagle_config") or {}
    EAGLE_CONFIG_KEYS.check_keys(eagle, "config.json eagle_config")
    if eagle.get("use_aux_hidden_state") is False:
        raise ConfigError("config.json eagle_config.use_aux_hidden_state: false (an EAGLE-1/2 style head fed the "
                          "last hidden state only) is not supported; EAGLE-3 heads tap several layers")
    layer, _ = _layer(raw, "config.json", ("llama",))  # LlamaForCausalLMEagle3: a Llama layer
    # SpecForge's eagle_config ids name layers whose *output* is tapped: the input of the next one
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    return Eagle3Config(layer=layer, draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
                        target_hidden_size=int(raw.get("target_hidden_size") or layer.hidden_size),
                        aux_layer_ids=None if ids is None else tuple(int(i) + 1 for i in ids),
                        norm_before_residual=bool(raw.get("norm_before_residual", False)),
                        fc_norm=bool(raw.get("fc_norm", False)),
                        # SpecForge's norm_output (default true) says whether lm_head reads the final norm
                        readout_norm=bool(raw.get("norm_output", True)))


def _angelslim(raw: dict[str, Any]) -> Eagle3Config:
    ANGELSLIM_DIALECT.check_keys(raw)
    layer, _ = _layer(raw, "config.json", ("llama",))  # Eagle3LlamaForCausalLM: a Llama layer
    return Eagle3Config(layer=layer, draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
                        target_hidden_size=int(raw.get("target_hidden_size") or layer.hidden_size),
                        aux_layer_ids=None, dialect="angelslim")


def _speculators(raw: dict[str, Any]) -> Eagle3Config:
    if raw["speculators_model_type"] != "eagle3":
        use = " (a DFlash drafter: use method: dflash)" if raw["speculators_model_type"] == "dflash" else ""
        raise ConfigError(f"speculators_model_type {raw['speculators_model_type']!r} is not eagle3{use}")
    SPECULATORS_DIALECT.check_keys(raw)
    runtime = raw.get("speculators_config") or {}
    SPECULATORS_RUNTIME.check_keys(runtime, "config.json speculators_config")
    if runtime.get("algorithm", "eagle3") != "eagle3":
        raise ConfigError(f"config.json speculators_config.algorithm {runtime['algorithm']!r} is not eagle3")
    inner = raw.get("transformer_layer_config")
    if not isinstance(inner, dict):
        raise ConfigError("speculators config lacks transformer_layer_config (the draft layer's Llama or Qwen3 fields)")
    SPECULATORS_LAYER.check_keys(inner, "config.json transformer_layer_config")
    if raw.get("norm_before_fc") and raw.get("fc_norm"):
        raise ConfigError("config.json: norm_before_fc and fc_norm are both true; speculators allows one or the other")
    layer, windows = _layer(inner, "config.json transformer_layer_config", ("qwen3", "llama"), deep_ok=True)
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    return Eagle3Config(layer=layer, draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
                        target_hidden_size=int(raw.get("target_hidden_size") or layer.hidden_size),
                        aux_layer_ids=None if ids is None else tuple(int(i) for i in ids),
                        norm_before_residual=bool(raw.get("norm_before_residual", False)),
                        norm_before_fc=bool(raw.get("norm_before_fc", False)), fc_norm=bool(raw.get("fc_norm", False)),
                        norm_output=bool(raw.get("norm_output", False)), layer_windows=windows,
                        dialect="speculators")


def _layer(raw: dict[str, Any], where: str, kinds: tuple[str, ...], deep_ok: bool = False
           ) -> tuple[ModelConfig, tuple[int | None, ...]]:
    """The draft layers: Llama or Qwen3 (by model_type, the first of ``kinds`` by default; q/k
    norms for Qwen3), exactly one unless ``deep_ok`` (speculators: more layers, sliding windows)
    -> (their config, each layer's sliding window or None)."""
    windows = layer_values(raw, where, sliding_ok=deep_ok)
    kind = raw.get("model_type", kinds[0])
    if kind not in kinds:
        raise ConfigError(f"{where}: model_type {kind!r} is not supported for this EAGLE-3 draft layer; "
                          f"supported: {', '.join(kinds)}")
    layers = int(raw.get("num_hidden_layers", 1))
    if layers < 1 or (layers > 1 and not deep_ok):
        raise ConfigError(f"{where}: num_hidden_layers {layers}; this dialect's EAGLE-3 heads have one decoder "
                          "layer (its weights name one midlayer, and the format defines no second layer's input), "
                          "so a deeper head would lose its other layers. Use a one-layer head, or the "
                          "speculators format, which defines deeper heads")
    cfg = model_config({**raw, "num_hidden_layers": layers}, default_arch=kind)
    return replace(cfg, arch=kind), windows


DIALECTS = {"eagle": EAGLE_DIALECT, "angelslim": ANGELSLIM_DIALECT, "speculators": SPECULATORS_DIALECT}
