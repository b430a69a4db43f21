"""gemma4_mtp: the drafter's chain over the target's frozen KV against the training-time
recomputation, its objective, and the spec's method-specific checks."""


import pytest
import torch

from conftest import tiny_spec
from draftline.core.engine import Engine
from draftline.core.methods.gemma4_mtp import chain_outputs, training_loss
from draftline.core.models.gemma4_mtp import random_mtp
from draftline.core.models.loader import random_target
from draftline.core.sampling import SamplingParams
from draftline.core.spec import SpecError

MTP = {"method": "gemma4_mtp", "draft": {"random_init": {"preset": "tiny-mtp", "seed": 1}}, "num_speculative_tokens": 3}


def test_engine_chain_equals_the_training_recomputation():
    """Drafts the engine makes (greedy, through the reference backend's frozen target KV) are
    the argmax of chain_outputs at the round's context end, fed the drafts themselves."""
    engine = Engine(tiny_spec(MTP, max_batch_size=1))
    out = engine.generate(["def f(x):\n    return"], SamplingParams(max_new_tokens=12, ignore_eos=True), trace=True)[0]
    emb = engine.target.model.embed_tokens.weight
    model = engine.backend.drafter.model
    prompt = engine.encode("def f(x):\n    return")
    for rnd in out.rounds[:4]:
        seq = (prompt + out.output_ids)[: rnd.position] + list(rnd.drafted)  # the round's tokens, then its drafts
        with torch.no_grad():
            outs = chain_outputs(model, engine.target, torch.tensor([seq], device=engine.device), steps=3)
        c = rnd.position - 2  # last verified position (the round's last token sits at rnd.position - 1)
        got = [int(model.logits(outs[j][0, c], emb).argmax()) for j in range(3)]
        assert got == list(rnd.drafted)


def test_training_loss_falls():
    torch.manual_seed(2)
    target, model = random_target("tiny-qwen3", 0), random_mtp("tiny-mtp", 3)
    tokens = torch.randint(0, 256, (4, 24))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = start = None
    for _ in range(40):
        loss, correct, overlap = training_loss(model, target, tokens, steps=3)
        first = first if first is not None else loss.item()
        start = start if start is not None else overlap[0].mean().item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert correct.shape == overlap.shape == (3, 4, 23) and not correct[2, :, -2:].any()  # steps past the end count nothing
    assert not overlap[2, :, -2:].any() and bool(((overlap >= 0) & (overlap <= 1 + 1e-6)).all())
    assert overlap[0].mean().item() > start + 0.05  # sampled drafts: the drafter's q moved toward the target's p
    assert loss.item() < first - 0.5


@pytest.mark.parametrize("section,message", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"draft": {"random_init": {"preset": "nope"}}}, "unknown gemma4_mtp preset 'nope'"),
    ({"draft": {"random_init": {"preset": "tiny-code-mtp"}}}, "target_hidden_size 256"),
])
def test_spec_checks_name_the_field(section, message):
    with pytest.raises(SpecError, match=message):
        tiny_spec({**MTP, **section})
