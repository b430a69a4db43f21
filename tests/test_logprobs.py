"""Logprobs are the target's: log_softmax of its logits at each kept position, whether the
position was verified in a drafting window or decoded plainly; prompt logprobs come from prefill."""

from pathlib import Path

import pytest
import torch

from conftest import full_forward
from draftline.core.engine import Engine
from draftline.core.sampling import SamplingParams
from draftline.core.spec import load_spec

SPECS = Path(__file__).parent.parent / "specs"


@pytest.mark.parametrize("method", ["tiny-dflash.yaml", "tiny-eagle3.yaml"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_with_drafting_are_the_targets(method, temperature):
    engine = Engine(load_spec(SPECS / method), draft_policy="always")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=temperature, seed=7, logprobs=3,
                            prompt_logprobs=2, repetition_penalty=1.2)  # logprobs stay raw under penalties
    prompts = ["def fibonacci(n):", "import os\n"]
    outs = engine.generate(prompts, params)
    assert sum(c.meta_info["spec_accepted_tokens"] for c in outs) > 0  # positions inside accepted runs were checked
    for prompt, c in zip(prompts, outs):
        ids = engine.encode(prompt) + c.output_ids
        with torch.no_grad():
            hidden, _ = full_forward(engine.target, torch.tensor([ids]))
            want = torch.log_softmax(engine.target.logits(hidden[0]).float(), -1)  # [T, V]
        entries = c.prompt_logprobs + c.logprobs
        assert entries[0] is None and len(entries) == len(ids)
        for t in range(1, len(ids)):
            e = entries[t]
            assert e.token == ids[t] and e.logprob == pytest.approx(float(want[t - 1, ids[t]]), abs=1e-4)
            top = want[t - 1].topk(len(e.top))
            assert [i for i, _ in e.top] == top.indices.tolist()
            assert [lp for _, lp in e.top] == pytest.approx(top.values.tolist(), abs=1e-4)
