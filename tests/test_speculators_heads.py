"""speculators EAGLE-3 heads, as the real ``speculators`` package writes them: each option's
fixture (tests/fixtures/speculators, written by make_fixtures.py there) gives the logits
speculators' own forward gave, within 1e-4 in float32; each option changes them; and greedy
output with every fixture is the target's own."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_spec
from draftline.core.engine import Engine
from draftline.core.methods.eagle3 import chain_outputs
from draftline.core.models.eagle3 import Eagle3DraftModel, load_eagle3
from draftline.core.sampling import SamplingParams

FIXTURES = Path(__file__).parent / "fixtures" / "speculators"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir() and not p.name.startswith("dflash"))  # EAGLE-3


def _logits(model: Eagle3DraftModel, ref: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(draftline's, speculators') draft-vocabulary logits per training-time-test step, on the
    rows both define. speculators' row t of step j is the chain started at t; chain_outputs
    indexes by position, so that chain's step j sits at t + j."""
    steps = sum(k.startswith("logits.") for k in ref)
    length = ref["input_ids"].shape[1]
    with torch.no_grad():
        outs = chain_outputs(model, model.embed(None, ref["input_ids"]), model.fuse(ref["hidden_states"]), steps)
        return [(model.lm_head(model.readout(out))[:, j:], ref[f"logits.{j}"][:, : length - j])
                for j, out in enumerate(outs)]


def test_every_fixture_is_here():
    assert NAMES == sorted(["fc-norm", "full-vocab", "layer-zero", "llama", "norm-before-fc", "norm-before-residual",
                            "norm-output", "qwen3", "sliding-window", "trained-defaults", "two-layers"])


@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_speculators_forward(name):
    folder = FIXTURES / name
    model = load_eagle3(folder)
    assert model.embed_tokens is not None  # no target to compare with here: the checkpoint's embedding
    for j, (got, want) in enumerate(_logits(model, load_file(folder / "reference.safetensors"))):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4, msg=f"{name}, step {j}")


@pytest.mark.parametrize("name,off", [
    ("norm-before-fc", {"norm_before_fc": False}),
    ("fc-norm", {"fc_norm": False}),
    ("norm-output", {"norm_output": False}),
    ("norm-before-residual", {"norm_before_residual": False}),
    ("qwen3", "llama"),
])
def test_each_option_changes_the_drafts(name, off):
    """The fixtures are sensitive: the same weights with the option dropped give other logits."""
    folder = FIXTURES / name
    loaded = load_eagle3(folder)
    cfg = loaded.config
    cfg = replace(cfg, layer=replace(cfg.layer, arch=off)) if isinstance(off, str) else replace(cfg, **off)
    model = Eagle3DraftModel(cfg)
    model.own_embedding(loaded.embed_tokens.weight)
    model.load_state_dict(loaded.state_dict(), strict=False)  # the dropped option's weights go unused
    ref = load_file(folder / "reference.safetensors")
    assert max(float((got - want).abs().max()) for got, want in _logits(model.eval(), ref)) > 1e-2


@pytest.mark.parametrize("name", NAMES)
def test_greedy_output_equals_none(name):
    spec = tiny_spec({"method": "eagle3", "draft": {"path": str(FIXTURES / name)}, "num_speculative_tokens": 3})
    engine = Engine(spec)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompts = ["def fibonacci(n):", "hello"]
    got = [c.output_ids for c in engine.generate(prompts, params)]
    assert got == [c.output_ids for c in engine.with_method({"method": "none"}).generate(prompts, params)]
    assert engine.backend.drafter.model.embed_tokens is not None  # the fixture's embedding is not the random target's


def test_taps_at_both_ends():
    """Layer id 0 (speculators: the input of layer 0) is the plan's tap -1, the embeddings;
    layer id N (the input of a layer after the last) is tap N - 1, the output before the norm."""
    from conftest import full_forward
    from draftline.core.models.loader import random_target

    target = random_target("tiny-qwen3", 0)
    ids = torch.randint(0, 384, (1, 7))
    _, features = full_forward(target, ids, (-1, 2))
    assert torch.equal(features[..., :128], target.embed(ids))
    assert torch.equal(features[..., 128:], full_forward(target, ids, (2,))[1])
    hidden, last = full_forward(target, ids, (5,))
    assert torch.equal(target.model.norm(last), hidden)


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in NAMES if n not in ("sliding-window", "two-layers")]
                         + ["dflash", "dflash-draft-vocab"])  # the others: refused
def test_cuda_backend_drafts_what_the_reference_drafts(name):
    """The cuda backend's fused chain (graphs, Triton kernels) computes each option as the
    reference does: float32, the same tokens and the same drafts every round; bf16 greedy
    output equals `none`'s."""
    from conftest import respec

    method = {"method": "eagle3", "draft": {"path": str(FIXTURES / name)}, "num_speculative_tokens": 3}
    if name.startswith("dflash"):
        method = {"method": "dflash", "draft": {"path": str(FIXTURES / name)}}
    spec = tiny_spec(method, max_batch_size=4, device="cuda", dtype="float32", max_model_len=128)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompts = ["def fibonacci(n):", "x", "import os\nclass A:\n", "hello world"]
    ref = Engine(spec).generate(prompts, params, trace=True)
    got = Engine(respec(spec, "cuda")).generate(prompts, params, trace=True)
    for r, g in zip(ref, got):
        assert g.output_ids == r.output_ids
        assert [x.drafted for x in g.rounds] == [x.drafted for x in r.rounds]
    bf16 = Engine(respec(spec, "cuda", dtype="bfloat16"))
    assert [c.output_ids for c in bf16.generate(prompts, params)] == \
        [c.output_ids for c in bf16.with_method({"method": "none"}).generate(prompts, params)]


DFLASH = ["dflash", "dflash-sliding-window", "dflash-sliding-non-causal", "dflash-draft-vocab"]


@pytest.mark.parametrize("name", DFLASH)
def test_speculators_dflash_logits_equal_speculators_forward(name):
    """A DFlash drafter in the speculators format: each block [anchor token, MASK x (B-1)]
    over the features strictly before its anchor gives speculators' logits (the target's
    embedding and read-out, which the checkpoint does not store, come with the reference),
    through the reference backend's attention (a sliding layer: the last `window` context
    positions, its block causal)."""
    from draftline.backends.reference.kv import ReferenceKV
    from draftline.core.models.loader import load_dflash

    folder = FIXTURES / name
    ref = load_file(folder / "reference.safetensors")
    model = load_dflash(folder)
    cfg = model.config
    assert cfg.dialect == "speculators DFlash" and cfg.target_layer_ids == (-1, 2, 5) and cfg.block_size == 4
    assert cfg.windows() == ({0: 3} if "sliding" in name else {})
    assert cfg.draft_vocab_size == (256 if name == "dflash-draft-vocab" else None)
    assert cfg.sliding_block_causal == (name != "dflash-sliding-non-causal")
    embed, head, kv = ref["embed_tokens.weight"], ref["lm_head.weight"], ReferenceKV()
    with torch.no_grad():
        for a, want in zip(ref["anchors"].tolist(), ref["logits"]):
            cache = kv.new(len(model.layers))
            for layer, (k, v) in enumerate(model.context_kv(ref["hidden_states"][:, :a], torch.arange(a)[None])):
                kv.append(cache, layer, k[0], v[0])
            windowed = {"windows": cfg.windows(), "block_causal": cfg.sliding_block_causal} if cfg.windows() else {}
            attend = kv.attention([cache], causal=False, persist=False, **windowed)

            block = torch.tensor([[int(ref["input_ids"][0, a])] + [cfg.mask_token_id] * (cfg.block_size - 1)])
            hidden = model(embed[block], a + torch.arange(cfg.block_size)[None], attend)
            torch.testing.assert_close(hidden[0] @ head.T, want, rtol=0, atol=1e-4, msg=f"anchor {a}")
            if cfg.draft_vocab_size is not None:  # its own head, its logits at their target ids
                assert torch.equal(model.head(None).weight, head)
                full = model.logits(hidden[0], None)
                torch.testing.assert_close(full[:, torch.arange(256) + model.d2t], want, rtol=0, atol=1e-4)
                assert torch.isinf(full).sum(-1).eq(384 - 256).all()


@pytest.mark.parametrize("name", DFLASH)
def test_speculators_dflash_greedy_output_equals_none(name):
    spec = tiny_spec({"method": "dflash", "draft": {"path": str(FIXTURES / name)}})
    engine = Engine(spec)
    assert engine.plan.target_layer_ids == (-1, 2, 5) and engine.plan.num_speculative_tokens == 3
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompts = ["def fibonacci(n):", "hello"]
    got = [c.output_ids for c in engine.generate(prompts, params)]
    assert got == [c.output_ids for c in engine.with_method({"method": "none"}).generate(prompts, params)]


@pytest.mark.parametrize("name", NAMES)
def test_cached_chain_equals_uncached_recompute(name):
    """The reference drafter's cached chain for each head (its options in the chain's feedback;
    a sliding window anchored at the chain's start, as speculators trains it) against a
    recomputation over the whole sequence with explicit masks, over rounds that accept
    different numbers of drafts."""
    from types import SimpleNamespace

    from draftline.backends.reference.kv import ReferenceKV
    from conftest import full_forward
    from draftline.core.machine import Plan
    from draftline.core.methods.eagle3 import Eagle3Drafter
    from draftline.core.models.loader import random_target

    torch.manual_seed(0)
    target, model = random_target("tiny-qwen3", 0), load_eagle3(FIXTURES / name)
    windows, k, taps = model.config.windows(), 3, (0, 1, 2)
    plan = Plan(method="eagle3", drafting="chain", num_speculative_tokens=k, target_layer_ids=taps)
    drafter = Eagle3Drafter(model, target, ReferenceKV(), plan)

    def uncached(tokens: list[int]) -> list[int]:
        ids = torch.tensor([tokens])
        _, feats = full_forward(target, ids[:, :-1], taps)
        embeds, hidden, start, drafts = model.embed(None, ids[:, 1:]), model.fuse(feats), len(tokens) - 2, []
        for _ in range(k):
            n = embeds.shape[1]
            p = torch.arange(n)

            def attend(layer, q, kk, v, p=p):
                sees = p[None] <= p[:, None]
                if layer in windows:
                    sees = sees & (p[None] > p[:, None].clamp(max=start) - windows[layer])
                return torch.nn.functional.scaled_dot_product_attention(q, kk, v, attn_mask=sees, enable_gqa=True)

            out = model.step(embeds, hidden, p[None], attend)
            drafts.append(int(model.logits(out[0, -1]).argmax()))
            embeds = torch.cat([embeds, model.embed(None, torch.tensor([[drafts[-1]]]))], dim=1)
            hidden = torch.cat([hidden, model.next_hidden(out[:, -1:])], dim=1)
        return drafts

    tokens = torch.randint(0, 256, (12,)).tolist()
    req = SimpleNamespace(draft_state=None, token_ids=tokens)
    with torch.no_grad():
        drafter.extend(req, full_forward(target, torch.tensor([tokens[:-1]]), taps)[1][0], 0)
        for accepted in (2, 0, k):
            got = drafter.propose([req], None).tokens[0].tolist()
            assert got == uncached(req.token_ids)
            first = len(req.token_ids) - 1
            req.token_ids = req.token_ids + got[:accepted] + [int(torch.randint(0, 256, ()))]
            drafter.extend(req, full_forward(target, torch.tensor([req.token_ids[:-1]]), taps)[1][0, first:], first)


def test_sliding_window_heads_refuse_the_cuda_backend():
    """The cuda backend's drafter caches have no sliding window: refused, naming the fix."""
    pytest.importorskip("triton")
    from draftline.backends.cuda.kv import StaticStore
    from draftline.core.machine import Plan
    from draftline.core.methods.eagle3 import Eagle3Drafter
    from draftline.core.models.config import ConfigError
    from draftline.core.models.loader import random_target

    plan = Plan(method="eagle3", drafting="chain", num_speculative_tokens=3, target_layer_ids=(0, 1, 2))
    with pytest.raises(ConfigError, match=r"layers \[0\] attend through sliding windows.*backend: reference"):
        Eagle3Drafter(load_eagle3(FIXTURES / "sliding-window"), random_target("tiny-qwen3", 0),
                      StaticStore(2, 64, torch.device("cpu")), plan)


ROUNDS = [n for n in NAMES if n not in ("sliding-window", "two-layers")]  # the fixtures with a scripted generate


@pytest.mark.parametrize("name", ROUNDS)
def test_drafts_equal_speculators_every_round(name):
    """A scripted generate (features per position, accepted counts, the token added after each
    round's accepted drafts): the reference drafter's cached chain drafts, every round, what
    speculators' own modules draft over the same context (make_fixtures.py: chain)."""
    from types import SimpleNamespace

    from draftline.backends.reference.kv import ReferenceKV
    from draftline.core.machine import Plan
    from draftline.core.methods.eagle3 import Eagle3Drafter

    ref = load_file(FIXTURES / name / "reference.safetensors")
    feats, k = ref["rounds.features"], ref["rounds.drafts"].shape[1]
    plan = Plan(method="eagle3", drafting="chain", num_speculative_tokens=k, target_layer_ids=(0, 1, 2))
    drafter = Eagle3Drafter(load_eagle3(FIXTURES / name), None, ReferenceKV(), plan)  # its own embedding
    req = SimpleNamespace(draft_state=None, token_ids=ref["rounds.prompt"].tolist())
    drafter.extend(req, feats[: len(req.token_ids) - 1], 0)
    with torch.no_grad():
        for want, accepted, bonus in zip(ref["rounds.drafts"].tolist(), ref["rounds.accepted"].tolist(),
                                         ref["rounds.bonus"].tolist()):
            got = drafter.propose([req], None).tokens[0].tolist()
            assert got == want
            first = len(req.token_ids) - 1
            req.token_ids = req.token_ids + got[:accepted] + [bonus]
            drafter.extend(req, feats[first : len(req.token_ids) - 1], first)
