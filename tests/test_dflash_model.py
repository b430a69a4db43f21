"""The DFlash drafter: z-lab checkpoint dialect round-trip, and its attention checked by
perturbing inputs: non-causal inside the block, context only from before the anchor."""

import pytest
import torch

from draftline.backends.reference.kv import ReferenceKV
from conftest import full_forward, tiny_spec
from draftline.core.engine import Engine
from draftline.core.models.checkpoint import CheckpointError, save_checkpoint
from draftline.core.models.config import ConfigError
from draftline.core.models.loader import load_dflash, random_dflash
from draftline.core.models.presets import draft_preset_raw
from draftline.core.sampling import SamplingParams

ZLAB_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": 16,
    "dflash_config": {"mask_token_id": 257, "target_layer_ids": [1, 3]},
    "num_target_layers": 6,
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": 384,
    "max_position_embeddings": 4096, "attention_bias": False, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "layer_types": ["full_attention", "full_attention"],
}

EXPECTED_NAMES = {
    "fc.weight", "hidden_norm.weight", "norm.weight",
    "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
    "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight",
    "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight",
    "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
}


def test_zlab_dialect_round_trip(tmp_path):
    src = random_dflash("tiny-dflash", seed=3)
    assert EXPECTED_NAMES <= {n for n, _ in src.named_parameters()}
    save_checkpoint(tmp_path, ZLAB_CONFIG, src)
    loaded = load_dflash(tmp_path)
    assert loaded.config.block_size == 16 and loaded.config.target_layer_ids == (1, 3)
    assert loaded.config.mask_token_id == 257
    for (name, a), (_, b) in zip(src.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), name


def test_default_layer_ids_when_config_has_none(tmp_path):
    cfg = {**ZLAB_CONFIG, "dflash_config": {"mask_token_id": 257}}
    save_checkpoint(tmp_path, cfg, random_dflash("tiny-dflash", seed=3))
    assert load_dflash(tmp_path).config.target_layer_ids == (1, 3)  # evenly 1..N-3 for N=6


def test_wrong_architecture_and_missing_tensor(tmp_path):
    save_checkpoint(tmp_path, {**ZLAB_CONFIG, "architectures": ["Qwen3ForCausalLM"]}, random_dflash("tiny-dflash", 0))
    with pytest.raises(ConfigError, match="DFlashDraftModel"):
        load_dflash(tmp_path)
    model = random_dflash("tiny-dflash", 0)
    del model.fc
    save_checkpoint(tmp_path, ZLAB_CONFIG, model)
    with pytest.raises(CheckpointError, match=r"fc\.weight"):
        load_dflash(tmp_path)


def _block_hidden(model, ctx, block):
    """Run the drafter on context features ctx [C, n*H] and block embeddings block [T, H]."""
    kv = ReferenceKV()
    cache = kv.new(len(model.layers))
    c = ctx.shape[0]
    for layer, (k, v) in enumerate(model.context_kv(ctx[None], torch.arange(c)[None])):
        kv.append(cache, layer, k[0], v[0])
    positions = torch.arange(c, c + block.shape[0])[None]
    return model(block[None], positions, kv.attention([cache], causal=False, persist=False))[0]


def test_block_attention_is_non_causal_and_reads_context():
    torch.manual_seed(0)
    model = random_dflash("tiny-dflash", seed=5)
    ctx, block = torch.randn(9, 256), torch.randn(16, 128)
    with torch.no_grad():
        base = _block_hidden(model, ctx, block)
        later = block.clone()
        later[12] += 1.0  # a later block slot changes an earlier slot's output: no causal mask
        assert (base[3] - _block_hidden(model, ctx, later)[3]).abs().max() > 1e-3
        early = ctx.clone()
        early[0] += 1.0  # the first context position reaches every slot
        assert (base[15] - _block_hidden(model, early, block)[15]).abs().max() > 1e-3


def test_drafter_context_is_exactly_the_target_features_before_the_anchor():
    """After real rounds, the drafter's cached context K/V equal K/V computed from a fresh
    full target forward over tokens[:anchor]: no rejected position leaks in, none is missed.
    Perturbing one more (future) context row changes the drafts, so the check is sensitive."""
    engine = Engine(tiny_spec())
    req = engine.add_request("def f(x):\n    return", SamplingParams(max_new_tokens=9, ignore_eos=True))
    for _ in range(4):
        engine.step()
    drafter = engine.backend.drafter
    drafter.store_pending(req)  # the last round's context waits for the next draft
    anchor = req.seq_len - 1
    ids = torch.tensor([req.token_ids[:anchor]])
    with torch.no_grad():
        _, feats = full_forward(engine.target, ids, engine.plan.target_layer_ids)
        expect = drafter.model.context_kv(feats, torch.arange(anchor)[None])
    cache = req.draft_state
    assert cache.length() == anchor
    for layer, (k, v) in enumerate(expect):
        torch.testing.assert_close(cache.k[layer], k[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cache.v[layer], v[0], rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        before = drafter.propose([req], engine.backend.draft_rows([req])).tokens
        drafter.extend(req, feats[0, -1:] * 3.0, anchor)  # a leaked row at the anchor position
        after = drafter.propose([req], engine.backend.draft_rows([req])).tokens
    assert not torch.equal(before, after)


def test_plain_rounds_store_no_context_until_the_request_drafts_again():
    """Rounds decoded plainly (two rows, drafting only up to one) leave their context pending,
    so they cost no drafter work; the next draft stores the whole run in one forward, equal to
    K/V from a full target forward, and a finished request leaves nothing behind."""
    spec = tiny_spec()
    data = spec.model_dump(mode="python")
    data["speculative"]["max_draft_batch"] = 1
    engine = Engine(type(spec).model_validate(data))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in ("def f(x):\n    return", "class A:\n    pass")]
    for _ in range(5):
        engine.step()
    drafter, req = engine.backend.drafter, reqs[0]
    anchor = req.seq_len - 1
    assert len(req.output_ids) > 3 and req.draft_state.length() == 0  # prompt and rounds alike pending
    start, end, parts = drafter.pending[id(req.draft_state)]
    assert (start, end, sum(len(f) for f in parts)) == (0, anchor, anchor)
    with torch.no_grad():
        drafter.propose([req], engine.backend.draft_rows([req]))
        _, feats = full_forward(engine.target, torch.tensor([req.token_ids[:anchor]]), engine.plan.target_layer_ids)
        expect = drafter.model.context_kv(feats, torch.arange(anchor)[None])
    assert id(req.draft_state) not in drafter.pending and req.draft_state.length() == anchor
    for layer, (k, v) in enumerate(expect):
        torch.testing.assert_close(req.draft_state.k[layer], k[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(req.draft_state.v[layer], v[0], rtol=1e-4, atol=1e-5)
    while engine.scheduler.has_work():
        engine.step()
    assert drafter.pending == {}


def test_preset_matches_zlab_fields():
    raw = draft_preset_raw("qwen3-8b-dflash")
    assert raw["dflash_config"]["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert raw["block_size"] == 16 and raw["num_hidden_layers"] == 5
