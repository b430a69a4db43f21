"""No silent fields: every drafter dialect refuses a config key or a tensor it does not know,
by name, and refuses values its modules do not compute; nothing is dropped quietly."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_spec
from draftline.core.engine import Engine
from draftline.core.models.checkpoint import CheckpointError, save_checkpoint
from draftline.core.models.config import ConfigError
from draftline.core.models.eagle3 import PRESETS as EAGLE3_PRESETS
from draftline.core.models.eagle3 import load_eagle3, random_eagle3
from draftline.core.models.gemma4_mtp import PRESETS as MTP_PRESETS
from draftline.core.models.gemma4_mtp import load_mtp, random_mtp
from draftline.core.models.loader import load_dflash, random_dflash, random_target
from draftline.core.models.presets import DRAFT_PRESETS

SPECULATORS = Path(__file__).parent / "fixtures" / "speculators" / "llama"
SPECULATORS_DFLASH = SPECULATORS.parent / "dflash"


def _dflash(folder: Path) -> Path:
    return save_checkpoint(folder, DRAFT_PRESETS["micro-dflash"], random_dflash("micro-dflash", 0))


def _eagle(folder: Path) -> Path:
    model = random_eagle3("micro-eagle3", 0)
    return save_checkpoint(folder, EAGLE3_PRESETS["micro-eagle3"], model, extra={"d2t": model.d2t, "t2d": model.t2d})


def _speculators(folder: Path) -> Path:
    shutil.copytree(SPECULATORS, folder, ignore=shutil.ignore_patterns("reference.safetensors"))
    return folder


def _speculators_dflash(folder: Path) -> Path:
    shutil.copytree(SPECULATORS_DFLASH, folder, ignore=shutil.ignore_patterns("reference.safetensors"))
    return folder


def _mtp(folder: Path) -> Path:
    return save_checkpoint(folder, MTP_PRESETS["micro-mtp"], random_mtp("micro-mtp", 0))


ANGELSLIM = {  # the keys of AngelSlim's qwen3-8b-eagle3.json training config, at tiny-eagle3's shape
    "architectures": ["Eagle3LlamaForCausalLM"], "model_type": "llama", "target_model_type": "qwen3",
    "torch_dtype": "bfloat16", "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "head_dim": 32, "hidden_act": "silu", "hidden_size": 128, "initializer_range": 0.02,
    "intermediate_size": 256, "max_position_embeddings": 4096, "max_window_layers": 6, "num_attention_heads": 4,
    "num_hidden_layers": 1, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 10000.0, "sliding_window": None, "tie_word_embeddings": False, "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 384, "draft_vocab_size": 256,
}


def _angelslim(folder: Path) -> Path:
    model = random_eagle3("tiny-eagle3", 0)
    return save_checkpoint(folder, ANGELSLIM, model, extra={"d2t": model.d2t, "t2d": model.t2d})


DIALECTS = {  # name in messages -> (writer, loader)
    "z-lab DFlash": (_dflash, load_dflash),
    "EAGLE / SpecForge EAGLE-3": (_eagle, load_eagle3),
    "speculators EAGLE-3": (_speculators, load_eagle3),
    "speculators DFlash": (_speculators_dflash, load_dflash),
    "frozen-KV MTP": (_mtp, load_mtp),
    "AngelSlim EAGLE-3": (_angelslim, load_eagle3),
}


def _edit_config(folder: Path, edit) -> None:
    raw = json.loads((folder / "config.json").read_text())
    edit(raw)
    (folder / "config.json").write_text(json.dumps(raw))


def _add_tensor(folder: Path, name: str) -> None:
    tensors = load_file(folder / "model.safetensors")
    tensors[name] = torch.zeros(4)
    save_file(tensors, str(folder / "model.safetensors"))


@pytest.mark.parametrize("dialect", DIALECTS)
def test_each_dialect_refuses_an_unknown_key_and_an_unknown_tensor(tmp_path, dialect):
    write, load = DIALECTS[dialect]
    load(write(tmp_path / "ok"))  # the dialect's own checkpoint loads

    folder = write(tmp_path / "key")
    _edit_config(folder, lambda raw: raw.update(attention_sink_tokens=4))
    with pytest.raises(ConfigError, match=rf"key 'attention_sink_tokens' is not part of the {dialect}.*Remove the key"):
        load(folder)

    folder = write(tmp_path / "tensor")
    _add_tensor(folder, "extra_proj.weight")
    with pytest.raises(CheckpointError, match=rf"tensor 'extra_proj.weight' is not part of the {dialect}"):
        load(folder)


@pytest.mark.parametrize("writer,section,where", [
    (_speculators, "transformer_layer_config", "transformer_layer_config"),
    (_speculators, "speculators_config", "speculators_config"),
    (_eagle, "eagle_config", "eagle_config"),
    (_dflash, "dflash_config", "dflash_config"),
    (_speculators_dflash, "speculators_config", "speculators_config"),
    (_speculators_dflash, "transformer_layer_config", "transformer_layer_config"),
])
def test_nested_sections_refuse_unknown_keys(tmp_path, writer, section, where):
    folder = writer(tmp_path / "c")
    _edit_config(folder, lambda raw: raw.setdefault(section, {}).update(new_knob=1))
    with pytest.raises(ConfigError, match=rf"config.json {where}: key 'new_knob'"):
        load_eagle3(folder) if writer in (_speculators, _eagle) else load_dflash(folder)


def _layer(raw: dict) -> dict:
    return raw["transformer_layer_config"]


@pytest.mark.parametrize("edit,message", [
    (lambda r: _layer(r).update(layer_types=["chunked_attention"]),
     r"layer_types gives layer\(s\) \[0\] attention \['chunked_attention'\]"),
    (lambda r: _layer(r).update(layer_types=["sliding_attention"], sliding_window=None),
     "sliding_attention layers need a positive sliding_window, got None"),
    (lambda r: _layer(r).update(use_sliding_window=True), "use_sliding_window: true without layer_types"),
    (lambda r: _layer(r).update(model_type="mistral"), "model_type 'mistral' is not supported"),
    (lambda r: _layer(r).update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (lambda r: _layer(r).update(mlp_bias=True), "mlp_bias: true is not supported"),
    (lambda r: _layer(r)["rope_parameters"].update(partial_rotary_factor=0.5),
     "rope_parameters.partial_rotary_factor is not read"),
    (lambda r: r.update(norm_before_fc=True, fc_norm=True), "norm_before_fc and fc_norm are both true"),
    (lambda r: r["speculators_config"].update(algorithm="dflash"), "algorithm 'dflash' is not eagle3"),
])
def test_speculators_values_it_does_not_compute_are_refused(tmp_path, edit, message):
    folder = _speculators(tmp_path / "c")
    _edit_config(folder, edit)
    with pytest.raises(ConfigError, match=message):
        load_eagle3(folder)


@pytest.mark.parametrize("edit,message", [
    (lambda r: r.update(draft_vocab_size=500), r"draft_vocab_size 500 is outside 1\.\.vocab_size \(384\)"),
    (lambda r: r.update(sample_from_anchor=True), "sample_from_anchor: true"),
    (lambda r: r["speculators_config"].update(algorithm="dspark"), "algorithm 'dspark' is not dflash"),
    (lambda r: r.update(speculators_model_type="eagle3"), "not a DFlash drafter \\(an EAGLE-3 head: use method: eagle3\\)"),
    (lambda r: _layer(r).update(layer_types=["full_attention", "chunked_attention"]), r"layer\(s\) \[1\]"),
    (lambda r: _layer(r).update(layer_types=["full_attention"]), "layer_types lists 1 layers, num_hidden_layers is 2"),
])
def test_speculators_dflash_values_it_does_not_compute_are_refused(tmp_path, edit, message):
    folder = _speculators_dflash(tmp_path / "c")
    _edit_config(folder, edit)
    with pytest.raises(ConfigError, match=message):
        load_dflash(folder)


def test_a_missing_option_tensor_is_named(tmp_path):
    folder = _speculators(tmp_path / "c")
    _edit_config(folder, lambda raw: raw.update(norm_before_fc=True))  # input_norm.weight is not in the file
    with pytest.raises(CheckpointError, match="missing tensor.*input_norm.weight"):
        load_eagle3(folder)


def test_vocabulary_maps_must_agree(tmp_path):
    folder = _speculators(tmp_path / "c")
    tensors = load_file(folder / "model.safetensors")
    tensors["t2d"] = ~tensors["t2d"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="t2d and d2t disagree"):
        load_eagle3(folder)


def test_a_frozen_copy_of_the_target_embedding_is_dropped(tmp_path):
    """A head whose embed_tokens is the target's reads the target's (one copy in memory);
    one whose embed_tokens differs keeps its own (test_speculators_heads)."""
    folder = _speculators(tmp_path / "c")
    tensors = load_file(folder / "model.safetensors")
    tensors["embed_tokens.weight"] = random_target("tiny-qwen3", 0).model.embed_tokens.weight.detach().clone()
    save_file({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()},
              str(folder / "model.safetensors"))
    engine = Engine(tiny_spec({"method": "eagle3", "draft": {"path": str(folder)}}))
    assert engine.backend.drafter.model.embed_tokens is None



def test_angelslim_heads_load_with_its_tap_convention(tmp_path):
    """No ids in the config: AngelSlim's targets tap the inputs of layers 2, N/2 and N-3, so
    the plan taps the outputs of layers 1, 2, 2 of the 6-layer target."""
    folder = _angelslim(tmp_path / "a")
    assert load_eagle3(folder).config.dialect == "angelslim"
    engine = Engine(tiny_spec({"method": "eagle3", "draft": {"path": str(folder)}}))
    assert engine.plan.target_layer_ids == (1, 2, 2)
    assert "AngelSlim EAGLE-3 dialect" in engine.plan.drafter


def test_angelslim_mrope_heads_are_refused(tmp_path):
    folder = _angelslim(tmp_path / "a")
    _edit_config(folder, lambda raw: raw.update(rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}))
    with pytest.raises(ConfigError, match="rope_scaling.mrope_section is not read"):
        load_eagle3(folder)


def test_specforge_fc_norm_and_norm_output(tmp_path):
    """SpecForge's fc_norm (an RMSNorm per tapped layer before fc) and norm_output: false
    (lm_head reads the layer's output without the final norm; speculators' norm_output means
    something else: the normed output fed back)."""
    from dataclasses import replace

    from draftline.core.models.eagle3 import Eagle3DraftModel, preset_config
    from draftline.core.models.layers import init_random

    cfg = replace(preset_config("micro-eagle3"), fc_norm=True, readout_norm=False)
    model = Eagle3DraftModel(cfg)
    init_random(model, 0, 0.1)
    model.t2d.fill_(True)  # the full vocabulary
    raw = {**EAGLE3_PRESETS["micro-eagle3"], "fc_norm": True, "norm_output": False}
    loaded = load_eagle3(save_checkpoint(tmp_path / "h", raw, model, extra={"d2t": model.d2t, "t2d": model.t2d}))
    assert loaded.config.fc_norm and not loaded.config.readout_norm and not loaded.config.norm_output
    feats, out = torch.randn(5, 96), torch.randn(5, 32)
    with torch.no_grad():
        normed = torch.cat([n(c) for n, c in zip(model.fc_norm, feats.chunk(3, dim=-1))], dim=-1)
        torch.testing.assert_close(loaded.fuse(feats), model.fc(normed))
        torch.testing.assert_close(loaded.logits(out)[:, loaded.draft_ids()], model.lm_head(out))
        assert torch.equal(loaded.next_hidden(out), out)
    assert "no final norm before lm_head" in ", ".join(loaded.config.options())


def test_z_lab_dflash_refuses_sliding_layers(tmp_path):
    folder = _dflash(tmp_path / "c")
    _edit_config(folder, lambda raw: raw.update(layer_types=["sliding_attention"], sliding_window=8))
    with pytest.raises(ConfigError, match=r"layer_types gives layer\(s\) \[0\] attention \['sliding_attention'\]"):
        load_dflash(folder)


def test_sliding_dflash_refuses_the_cuda_backend():
    pytest.importorskip("triton")
    from draftline.backends.cuda.kv import StaticStore
    from draftline.core.machine import Plan
    from draftline.core.methods.dflash import DFlashDrafter

    plan = Plan(method="dflash", drafting="parallel", num_speculative_tokens=3, target_layer_ids=(-1, 2, 5),
                block_size=4)
    with pytest.raises(ConfigError, match=r"layers \[0\] attend through sliding windows.*backend: reference"):
        DFlashDrafter(load_dflash(SPECULATORS.parent / "dflash-sliding-window"), random_target("tiny-qwen3", 0),
                      StaticStore(2, 64, torch.device("cpu")), plan, 257)


def test_eagle_dialect_heads_have_one_layer(tmp_path):
    folder = _eagle(tmp_path / "c")
    _edit_config(folder, lambda raw: raw.update(num_hidden_layers=2))
    with pytest.raises(ConfigError, match="num_hidden_layers 2; this dialect's EAGLE-3 heads have one decoder layer"):
        load_eagle3(folder)
