"""The target's logits equal Hugging Face transformers' on random tiny configs loaded from the
same safetensors folder (transformers is a test-only dependency)."""

import json

import pytest
import torch

from conftest import full_forward
from draftline.core.models.checkpoint import CheckpointError
from draftline.core.models.loader import load_target

transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def _qwen3():
    cfg = transformers.Qwen3Config(**COMMON, head_dim=24, rope_theta=10000.0, tie_word_embeddings=False)
    return transformers.Qwen3ForCausalLM(cfg)


def _llama(tied=False):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg = transformers.LlamaConfig(**COMMON, rope_parameters=rope, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(cfg)


def _perturb_norms(model):
    with torch.no_grad():  # HF inits norms to 1: randomise them so misuse would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def _compare(hf, folder, ids):
    ours = load_target(folder)
    with torch.no_grad():
        ref = hf(ids).logits
        hidden, _ = full_forward(ours, ids)
        got = ours.logits(hidden)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("make", [_qwen3, _llama, lambda: _llama(tied=True)], ids=["qwen3", "llama3", "llama3-tied"])
def test_logits_match_transformers(tmp_path, make):
    torch.manual_seed(0)
    hf = _perturb_norms(make())
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, COMMON["vocab_size"], (2, 37))
    _compare(hf, tmp_path, ids)


def _to_old_rope_form(folder):
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    if params.get("rope_type", "default") != "default":
        raw["rope_scaling"] = params
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize("make", [_qwen3, _llama], ids=["qwen3", "llama3"])
def test_old_rope_config_form_loads_identically(tmp_path, make):
    torch.manual_seed(1)
    hf = _perturb_norms(make())
    hf.save_pretrained(tmp_path)
    assert "rope_parameters" in json.loads((tmp_path / "config.json").read_text())
    _to_old_rope_form(tmp_path)
    _compare(hf, tmp_path, torch.randint(0, COMMON["vocab_size"], (1, 80)))


def test_sharded_checkpoint_loads(tmp_path):
    torch.manual_seed(2)
    hf = _perturb_norms(_qwen3())
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    _compare(hf, tmp_path, torch.randint(0, COMMON["vocab_size"], (1, 16)))


def test_missing_and_misshaped_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    _qwen3().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.self_attn.k_norm.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_target(tmp_path)
    tensors[name] = torch.ones(7)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"k_norm\.weight has shape \[7\]"):
        load_target(tmp_path)
