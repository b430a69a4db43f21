"""Block-scaled FP8 targets (the reference backend; the cuda one in test_cuda_fp8.py): the
checkpoint format (every key and dtype, refusals by name), the math against its blockwise
definition, the shipped tiny FP8 target (made from the bf16 one, its accuracy against it) and
lossless drafting over it."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import full_forward
from draftline.core.engine import Engine
from draftline.core.models.checkpoint import CheckpointError
from draftline.core.models.config import ConfigError, model_config, read_model_config
from draftline.core.models.fp8 import (FP8, FP8_MAX, Fp8Linear, dequantize, fp8_linear, fp8_scheme,
                                       quantize_activations, quantize_folder, quantize_weight)
from draftline.core.models.loader import load_target
from draftline.core.sampling import SamplingParams
from draftline.core.spec import load_spec
from draftline.core.training.corpus import read_prompts

SCHEME = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
FP8_TARGET, BF16_TARGET = "specs/tiny/target-fp8", "specs/tiny/target"


@pytest.mark.parametrize("change, needle", [
    ({"quant_method": "gptq"}, "quant_method 'gptq': only 'fp8'"),
    ({"modules_to_not_convert": []}, "unknown key(s) modules_to_not_convert"),
    ({"fmt": "e5m2"}, "fmt 'e5m2': only e4m3"),
    ({"activation_scheme": "static"}, "activation_scheme 'static': only 'dynamic'"),
    ({"weight_block_size": None}, "weight_block_size None: give [rows, columns]"),
    ({"weight_block_size": [128]}, "weight_block_size [128]"),
])
def test_other_quantization_is_refused_by_name(change, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        fp8_scheme({**SCHEME, **change})


def test_a_drafter_or_a_biased_projection_is_not_fp8():
    raw = json.loads(open(f"{BF16_TARGET}/config.json").read())
    with pytest.raises(ConfigError, match="a drafter loads in bf16 only"):
        model_config({**raw, "quantization_config": SCHEME})
    with pytest.raises(ConfigError, match="attention_bias with quantization_config fp8"):
        model_config({**raw, "quantization_config": SCHEME, "attention_bias": True}, quantized=True)
    assert model_config({**raw, "quantization_config": SCHEME}, quantized=True).fp8.block == (128, 128)


def test_weights_quantize_by_block_on_shapes_128_does_not_divide():
    torch.manual_seed(0)
    w = torch.randn(300, 200) * torch.linspace(0.1, 3, 200)  # columns of different ranges
    q, scale = quantize_weight(w, (128, 128))
    assert q.dtype == FP8 and q.shape == (300, 200) and scale.dtype == torch.float32 and scale.shape == (3, 2)
    back = dequantize(q, scale, (128, 128))
    for i in range(3):
        for j in range(2):
            tile = w[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)]
            assert scale[i, j] == tile.abs().max() / FP8_MAX  # the block's largest value maps to e4m3's largest
            err = (back[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)] - tile).abs().max()
            assert err <= tile.abs().max() / 16  # e4m3's 3 mantissa bits: half a step at the top binade


def test_activations_quantize_per_token_in_groups():
    x = torch.zeros(2, 3, 200)
    x[0, 0, :128] = torch.linspace(-5, 2, 128)
    x[0, 0, 128:] = 0.001
    q, scale = quantize_activations(x, 128)
    assert q.shape == (2, 3, 200) and scale.shape == (2, 3, 2)
    assert torch.allclose(scale[0, 0], torch.tensor([5 / FP8_MAX, 0.001 / FP8_MAX]))
    assert float(q[0, 0, 0].float()) == -FP8_MAX and bool((q[1].float() == 0).all())  # a zero token stays zero


def test_the_product_is_the_blockwise_sum_of_scaled_fp8_products():
    """What a block-scaled kernel computes (per 128-input block: the e4m3 dot product, times the
    token's group scale and the weight block's scale, summed in float32) equals the reference's
    dequantize-then-multiply, on shapes 128 does not divide."""
    torch.manual_seed(1)
    w, x = torch.randn(200, 300), torch.randn(5, 300, dtype=torch.bfloat16)
    q, ws = quantize_weight(w, (128, 128))
    xq, xs = quantize_activations(x, 128)
    want = torch.zeros(5, 200)
    for kb in range(3):
        cols = slice(128 * kb, 128 * (kb + 1))
        part = xq[:, cols].float() @ q[:, cols].float().T  # [5, 200]
        want += part * xs[:, kb : kb + 1] * ws[:, kb].repeat_interleave(128)[:200][None]
    got = fp8_linear(x, q, ws, (128, 128))
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    exact = fp8_linear(x.float(), q, ws, (128, 128))
    assert torch.allclose(exact, want, rtol=1e-5, atol=1e-5)


def test_the_shipped_fp8_target_is_the_bf16_one_quantized_in_the_hf_format(tmp_path):
    made = quantize_folder(BF16_TARGET, tmp_path / "fp8")
    assert made == {"quantized": 56, "kept": 34}  # 8 layers x 7 projections; norms, embeddings
    shipped, again = load_file(f"{FP8_TARGET}/model.safetensors"), load_file(str(tmp_path / "fp8" / "model.safetensors"))
    assert shipped.keys() == again.keys() and all(torch.equal(shipped[k].view(torch.uint8) if shipped[k].dtype == FP8
                                                              else shipped[k], again[k].view(torch.uint8)
                                                              if again[k].dtype == FP8 else again[k]) for k in shipped)
    raw = json.loads(open(f"{FP8_TARGET}/config.json").read())
    assert raw["quantization_config"] == SCHEME
    for name, t in shipped.items():
        if name.endswith("_scale_inv"):
            assert t.dtype == torch.float32 and f"{name.removesuffix('_scale_inv')}" in shipped
        elif "_proj." in name:
            assert t.dtype == FP8 and f"{name}_scale_inv" in shipped
        else:
            assert t.dtype == torch.bfloat16  # norms and the (tied) embedding
    model = load_target(FP8_TARGET).to(torch.bfloat16)  # a dtype cast leaves the fp8 weights and their scales
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, Fp8Linear) and q.weight.dtype == FP8 and q.weight_scale_inv.dtype == torch.float32
    assert torch.equal(q.weight_scale_inv, shipped["model.layers.0.self_attn.q_proj.weight_scale_inv"])


def _broken(tmp_path, edit) -> str:
    folder = tmp_path / "broken"
    shutil.copytree(FP8_TARGET, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    raw = json.loads((folder / "config.json").read_text())
    edit(tensors, raw)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw))
    return str(folder)


@pytest.mark.parametrize("edit, needle", [
    (lambda t, raw: raw.pop("quantization_config"), "is torch.float8_e4m3fn, but config.json has no quantization_config"),
    (lambda t, raw: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(768, 256, dtype=torch.bfloat16)}),
     "model.layers.0.mlp.up_proj.weight is torch.bfloat16, the config's quantization_config implies torch.float8_e4m3fn"),
    (lambda t, raw: t.update({"model.layers.1.mlp.up_proj.weight_scale_inv": torch.ones(6, 2, dtype=torch.bfloat16)}),
     "weight_scale_inv is torch.bfloat16"),
    (lambda t, raw: t.pop("model.layers.2.self_attn.k_proj.weight_scale_inv"),
     "missing tensor.* model.layers.2.self_attn.k_proj.weight_scale_inv"),
])
def test_a_checkpoint_that_disagrees_with_its_quantization_is_refused(tmp_path, edit, needle):
    folder = _broken(tmp_path, edit)
    with pytest.raises(CheckpointError, match=needle):
        load_target(folder)


def test_the_fp8_target_agrees_with_the_bf16_one_teacher_forced():
    """Greedy tokens under teacher forcing over shipped eval prompts and the bf16 target's own
    continuations of them: the quantized target's agree with the bf16 target's on >= 97% of
    positions (all 120 prompts with 128 tokens each: 97.8%; the prompts' own positions alone,
    text the model predicts least surely: 94.0%)."""
    engine = Engine(load_spec("specs/tiny-none.yaml"))
    prompts = read_prompts("specs/tiny/eval_prompts.jsonl")[:40]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=128, ignore_eos=True))
    targets = (load_target(BF16_TARGET).float(), load_target(FP8_TARGET).float())
    same = total = 0
    for out in outs:
        ids = torch.tensor([out.prompt_ids + out.output_ids])
        with torch.no_grad():
            bf16, fp8 = (t.logits(full_forward(t, ids)[0][0]).argmax(-1) for t in targets)
        same, total = same + int((bf16 == fp8).sum()), total + ids.shape[1]
    print(f"fp8 against bf16, teacher-forced greedy agreement {same / total:.4f} over {total} positions")
    assert same / total >= 0.97


@pytest.mark.parametrize("method", ["dflash", "eagle3", "gemma4-mtp"])
def test_drafting_over_the_fp8_target_is_lossless(method):
    spec = load_spec(f"specs/tiny-fp8-{method}.yaml")
    engine = Engine(spec, draft_policy="always")
    prompts = read_prompts("specs/tiny/eval_prompts.jsonl")[:2]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    got = engine.generate(prompts, params)
    plain = engine.with_method({"method": "none"}).generate(prompts, params)
    assert [c.output_ids for c in got] == [c.output_ids for c in plain]
    assert max(c.meta_info["spec_accept_length"] for c in got) > 1.5  # the bf16 drafters' drafts are accepted


def test_explain_names_the_scheme(capsys):
    from draftline.cli import main

    assert main(["explain", "specs/tiny-fp8-dflash.yaml"]) == 0
    assert "weights: fp8 e4m3 decoder projections, 128 x 128 weight blocks" in capsys.readouterr().out
    assert read_model_config(FP8_TARGET).fp8 is not None and read_model_config(BF16_TARGET).fp8 is None


def test_a_random_fp8_target_is_the_bf16_one_of_the_same_seed_quantized_and_its_bytes_are_counted():
    """random_init over an fp8 preset (specs/qwen3-8b-fp8-random-*.yaml's, here on the micro
    shape): each projection is the bf16 preset's draw quantized by block; bench's byte floor
    counts its e4m3 weights and float32 scales as stored."""
    from draftline.core.benchmark import matrix_bytes
    from draftline.core.models.layers import init_random
    from draftline.core.models.presets import target_preset_raw
    from draftline.core.models.target import TargetModel

    raw = target_preset_raw("micro")
    bf16, fp8 = (TargetModel(model_config(r, quantized=True)) for r in (raw, {**raw, "quantization_config": SCHEME}))
    for model in (bf16, fp8):
        init_random(model, seed=3, std=0.02)
    quantized = {name: m for name, m in fp8.named_modules() if isinstance(m, Fp8Linear)}
    assert len(quantized) == 7 * fp8.config.num_layers
    for name, m in quantized.items():
        q, scale = quantize_weight(bf16.get_submodule(name).weight.detach(), (128, 128))
        assert torch.equal(m.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(m.weight_scale_inv, scale)
    projections = sum(m.weight.numel() for m in quantized.values())
    scales = sum(m.weight_scale_inv.numel() for m in quantized.values())
    assert matrix_bytes(bf16) - matrix_bytes(fp8) == 4 * projections - (projections + 4 * scales)  # float32 model
