"""EAGLE-3: the cached chain against an uncached recomputation, both checkpoint dialects, and
the spec's method-specific checks."""

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from conftest import full_forward, tiny_spec
from draftline.backends.reference.kv import ReferenceKV
from draftline.core.machine import Plan
from draftline.core.methods.eagle3 import Eagle3Drafter
from draftline.core.models.checkpoint import CheckpointError
from draftline.core.models.config import ConfigError
from draftline.core.models.eagle3 import PRESETS, load_eagle3, random_eagle3
from draftline.core.models.layers import causal_attention
from draftline.core.models.loader import random_target
from draftline.core.spec import SpecError, parse_spec

K = 4
TAPS = (0, 2, 3)  # outputs of target layers 0, 2, 3: the inputs of layers 1, 3, 4 (tiny-eagle3's)


def _uncached_drafts(model, target, tokens: list[int], k: int) -> list[int]:
    """Recompute the head over the whole sequence at every chain step, no cache: position t
    reads embed(x_{t+1}) and fc(features_t); each chained position reads the previous output."""
    ids = torch.tensor([tokens])
    _, feats = full_forward(target, ids[:, :-1], TAPS)  # target features of positions 0 .. L-2
    embeds = target.embed(ids[:, 1:])  # x_1 .. x_{L-1}
    hidden = model.fc(feats)
    drafts = []
    for _ in range(k):
        positions = torch.arange(embeds.shape[1])[None]
        out = model.step(embeds, hidden, positions, causal_attention)
        token = int(model.logits(out[0, -1]).argmax())
        drafts.append(token)
        embeds = torch.cat([embeds, target.embed(torch.tensor([[token]]))], dim=1)
        hidden = torch.cat([hidden, out[:, -1:]], dim=1)
    return drafts


def _chain_at_prefill():
    """(target, head, its drafter on the reference store, a request whose prompt it has read)."""
    torch.manual_seed(0)
    target = random_target("tiny-qwen3", 0)
    model = random_eagle3("tiny-eagle3", 3)
    plan = Plan(method="eagle3", drafting="chain", num_speculative_tokens=K, target_layer_ids=TAPS)
    drafter = Eagle3Drafter(model, target, ReferenceKV(), plan)
    tokens = torch.randint(0, 256, (12,)).tolist()  # prompt 11 tokens + the first sampled one
    req = SimpleNamespace(draft_state=None, token_ids=tokens)
    _, feats = full_forward(target, torch.tensor([tokens[:-1]]), TAPS)
    drafter.extend(req, feats[0], 0)  # prefill: the prompt's features
    return target, model, drafter, req


def _accept(target, drafter, req, drafts: list[int], accepted: int) -> None:
    """The round accepts ``accepted`` drafts and adds a token of its own; the drafter reads the
    verified positions' features."""
    new = drafts[:accepted] + [int(torch.randint(0, 256, ()))]
    first = len(req.token_ids) - 1
    req.token_ids = req.token_ids + new
    _, feats = full_forward(target, torch.tensor([req.token_ids[:-1]]), TAPS)
    drafter.extend(req, feats[0, first:], first)


@torch.no_grad()
def test_cached_chain_equals_uncached_recompute_over_rounds():
    target, model, drafter, req = _chain_at_prefill()
    for accepted in (2, 0, K):
        got = drafter.propose([req], None).tokens[0].tolist()
        assert got == _uncached_drafts(model, target, req.token_ids, K)
        _accept(target, drafter, req, got, accepted)
    assert req.draft_state.start + req.draft_state.pending.shape[0] == len(req.token_ids) - 1


@torch.no_grad()
def test_a_narrower_verify_runs_a_shorter_chain_of_the_same_drafts():
    """A round that verifies fewer drafts (the draft policy's narrower widths) runs only those
    chain steps on the reference backend: the first drafts of the full chain, and the rounds
    after it chain from the same cache as after a full one."""
    target, model, drafter, req = _chain_at_prefill()
    for width, accepted in ((2, 1), (K + 1, 0), (3, 2), (K + 1, 2)):
        rows = SimpleNamespace(verified=lambda k, d=width - 1: min(k, d), argmax_drafts=lambda method: True,
                               scores=False)
        got = drafter.propose([req], rows).tokens[0].tolist()
        assert got == _uncached_drafts(model, target, req.token_ids, K)[: width - 1]
        _accept(target, drafter, req, got, accepted)


def _save(folder, config: dict, tensors: dict):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))


def _tensors(model, prefix: str = "midlayer."):
    out = {n.replace("midlayer.", prefix, 1): p.detach().clone() for n, p in model.named_parameters()}
    vd, v = model.config.draft_vocab_size, model.config.layer.vocab_size
    ids = torch.randperm(v)[:vd].sort().values  # the draft vocabulary: distinct target ids, ascending
    d2t = ids - torch.arange(vd)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    return {**out, "d2t": d2t, "t2d": t2d, "embed_tokens.weight": torch.zeros(384, 128)}  # the head's own embedding


@pytest.mark.parametrize("dialect", ["eagle", "speculators"])
def test_checkpoint_dialects_round_trip(tmp_path, dialect):
    model = random_eagle3("tiny-eagle3", 5)
    raw = PRESETS["tiny-eagle3"]
    if dialect == "speculators":
        inner = {k: v for k, v in raw.items() if k not in ("architectures", "draft_vocab_size", "eagle_config")}
        config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                  "transformer_layer_config": {**inner, "model_type": "llama"}, "draft_vocab_size": 256,
                  "eagle_aux_hidden_state_layer_ids": [1, 3, 4], "norm_before_residual": False,
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                         "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}]}}
        tensors = _tensors(model, "layers.0.")
    else:
        config, tensors = raw, _tensors(model)
    _save(tmp_path, config, tensors)
    loaded = load_eagle3(tmp_path)
    assert loaded.config.dialect == dialect and loaded.config.aux_layer_ids == (1, 3, 4)
    theirs = dict(loaded.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p, theirs.pop(n)), n
    assert list(theirs) == ["embed_tokens.weight"] and not theirs["embed_tokens.weight"].any()
    assert torch.equal(loaded.d2t, tensors["d2t"]) and torch.equal(loaded.t2d, tensors["t2d"])
    # logits live on the mapped target ids only
    logits = loaded.logits(torch.randn(128))
    assert torch.isfinite(logits).sum() == 256 and torch.isfinite(logits[loaded.draft_ids()]).all()


def test_checkpoint_errors_name_the_problem(tmp_path):
    model = random_eagle3("tiny-eagle3", 5)
    tensors = _tensors(model)
    del tensors["d2t"]
    _save(tmp_path / "a", PRESETS["tiny-eagle3"], tensors)
    with pytest.raises(CheckpointError, match="missing tensor d2t"):
        load_eagle3(tmp_path / "a")
    _save(tmp_path / "b", {**PRESETS["tiny-eagle3"], "architectures": ["LlamaForCausalLM"]}, _tensors(model))
    with pytest.raises(ConfigError, match="not an EAGLE-3 drafter"):
        load_eagle3(tmp_path / "b")
    _save(tmp_path / "c", {**PRESETS["tiny-eagle3"], "draft_vocab_size": 200}, _tensors(model))
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_eagle3(tmp_path / "c")


EAGLE3 = {"method": "eagle3", "draft": {"random_init": {"preset": "tiny-eagle3", "seed": 1}}}


@pytest.mark.parametrize("section,message", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"target_layer_ids": [1, 3, 7]}, r"\[7\] outside 0\.\.6"),
    ({"target_layer_ids": [-1, 3, 4]}, r"\[-1\] outside 0\.\.6"),
    ({"target_layer_ids": [1, 3]}, "2 ids given, the drafter's fc takes 3"),
    ({"draft": {"random_init": {"preset": "nope"}}}, "unknown eagle3 preset 'nope'"),
])
def test_spec_checks_name_the_field(section, message):
    with pytest.raises(SpecError, match=message):
        tiny_spec({**EAGLE3, **section})


def test_spec_refuses_a_drafter_made_for_another_target():
    data = tiny_spec(EAGLE3).model_dump(mode="json")
    data["speculative"]["draft"]["random_init"]["preset"] = "tiny-code-eagle3"  # width 256, vocab 4096
    with pytest.raises(SpecError, match="features of width 256"):
        parse_spec(data)


def _forced_chain(model, target, tokens: list[int], end: int, steps: int) -> list[torch.Tensor]:
    """The inference chain started after context position ``end``, fed the true next tokens
    instead of its own drafts, recomputed without a cache: step j's output at end + j."""
    ids = torch.tensor([tokens])
    _, feats = full_forward(target, ids, TAPS)
    embeds = target.embed(ids[:, 1 : end + 2])  # x_1 .. x_{end+1}
    hidden = model.fc(feats[:, : end + 1])
    outs = []
    for j in range(steps):
        out = model.step(embeds, hidden, torch.arange(embeds.shape[1])[None], causal_attention)
        outs.append(out[0, -1])
        embeds = torch.cat([embeds, target.embed(ids[:, end + j + 2 : end + j + 3])], dim=1)
        hidden = torch.cat([hidden, out[:, -1:]], dim=1)
    return outs


def test_training_time_test_equals_the_inference_chain():
    """chain_outputs (all positions, all steps at once, with the diagonal masks) gives exactly
    the outputs the drafter's chain computes at inference, fed the same tokens."""
    from draftline.core.methods.eagle3 import chain_outputs

    torch.manual_seed(1)
    target, model = random_target("tiny-qwen3", 0), random_eagle3("tiny-eagle3", 3)
    tokens = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        _, feats = full_forward(target, tokens, TAPS)
        outs = chain_outputs(model, target.embed(tokens[:, 1:]), model.fc(feats[:, :-1]), steps=4)
        for end in (0, 5, 11):
            for j, want in enumerate(_forced_chain(model, target, tokens[0].tolist(), end, 4)):
                torch.testing.assert_close(outs[j][0, end + j], want, rtol=1e-4, atol=1e-5)


def test_training_loss_falls_and_reports_agreement():
    from draftline.core.methods.eagle3 import training_loss

    torch.manual_seed(2)
    target, model = random_target("tiny-qwen3", 0), random_eagle3("tiny-eagle3", 3)
    tokens = torch.randint(0, 256, (4, 24))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = start = None
    for _ in range(60):
        loss, correct, overlap = training_loss(model, target, tokens, steps=3)
        first = first if first is not None else loss.item()
        start = start if start is not None else overlap[0].mean().item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert correct.shape == overlap.shape == (3, 4, 23) and not correct[2, :, :2].any()  # no 3-step chain before t = 2
    assert not overlap[2, :, :2].any() and bool(((overlap >= 0) & (overlap <= 1 + 1e-6)).all())
    assert overlap[0].mean().item() > start + 0.05  # sampled drafts: the head's q moved toward the target's p
    assert loss.item() < first - 0.8  # nats; the floor is the target's own entropy, about 5 here
