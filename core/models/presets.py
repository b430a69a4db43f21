"""Random-init model shapes, written as HF ``config.json`` dictionaries so that random and
loaded checkpoints go through the same parsing path."""

from __future__ import annotations

from typing import Any

from .config import DFlashConfig, ModelConfig, dflash_config, model_config

_TINY = {
    "vocab_size": 384,  # 256 bytes + end-of-text + mask + reserved (see tokenizer.byte_tokenizer)
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "eos_token_id": 256,
    # A wide init keeps random logits peaked, so greedy argmax has clear margins.
    "initializer_range": 0.1,
}

_QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "eos_token_id": 151645,
}

# The trained tiny family (vocab_size and eos_token_id come from the trained tokenizer).
_TINY_CODE = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "eos_token_id": 0,
    "initializer_range": 0.02,
}

# A micro shape for CI's few-step training runs.
_MICRO = {
    **_TINY_CODE,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
}

TARGET_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-code": _TINY_CODE,
    "micro": _MICRO,
    "tiny-qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **_TINY},
    "tiny-llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_TINY},
    "qwen3-8b": _QWEN3_8B,
    # Qwen3-8B-FP8's layout: decoder projections in e4m3 by 128 x 128 block (random_init quantizes
    # the bf16 preset's draws for the same seed), norms, embeddings and LM head in bf16
    "qwen3-8b-fp8": {**_QWEN3_8B, "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                                          "quant_method": "fp8", "weight_block_size": [128, 128]}},
}

DRAFT_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-code-dflash": {
        **_TINY_CODE,
        "architectures": ["DFlashDraftModel"],
        "num_hidden_layers": 2,
        "num_target_layers": 8,
        "block_size": 16,
        "dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 5]},
    },
    "tiny-code-dflash3": {
        **_TINY_CODE,
        "architectures": ["DFlashDraftModel"],
        "num_hidden_layers": 3,
        "num_target_layers": 8,
        "block_size": 16,
        "dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 3, 5]},
    },
    "tiny-code-dflash4": {
        **_TINY_CODE,
        "architectures": ["DFlashDraftModel"],
        "num_hidden_layers": 4,
        "num_target_layers": 8,
        "block_size": 16,
        "dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 3, 5]},
    },
    "micro-dflash": {
        **_MICRO,
        "architectures": ["DFlashDraftModel"],
        "num_hidden_layers": 1,
        "num_target_layers": 2,
        "block_size": 4,
        "dflash_config": {"mask_token_id": 1, "target_layer_ids": [1]},
    },
    "tiny-dflash": {
        **TARGET_PRESETS["tiny-qwen3"],
        "architectures": ["DFlashDraftModel"],
        "num_hidden_layers": 2,
        "num_target_layers": 6,
        "block_size": 16,
        "dflash_config": {"mask_token_id": 257, "target_layer_ids": [1, 3]},
    },
    "qwen3-8b-dflash": {
        **_QWEN3_8B,
        "architectures": ["DFlashDraftModel"],
        "num_hidden_layers": 5,
        "num_target_layers": 36,
        "block_size": 16,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    },
}


def lookup_preset(table: dict[str, dict[str, Any]], name: str, what: str) -> dict[str, Any]:
    """A preset table's entry, or a KeyError naming the known ones."""
    if name not in table:
        raise KeyError(f"unknown {what} preset {name!r}; known: {', '.join(sorted(table))}")
    return table[name]


def target_preset_raw(name: str) -> dict[str, Any]:
    return lookup_preset(TARGET_PRESETS, name, "target")


def target_preset(name: str) -> ModelConfig:
    return model_config(target_preset_raw(name), quantized=True)


def draft_preset_raw(name: str) -> dict[str, Any]:
    return lookup_preset(DRAFT_PRESETS, name, "drafter")


def dflash_preset(name: str) -> DFlashConfig:
    return dflash_config(draft_preset_raw(name))
