"""Penalties, logit_bias and min_new_tokens: plain decoding applies them as a hand-written
decoder does, and drafting keeps greedy output token-for-token the same (each verified
position sees the counts plain decoding would have there), for dflash and eagle3, batch 1 and 4."""

from pathlib import Path

import pytest
import torch

from conftest import argmax_drafts, full_forward
from draftline.core.engine import Engine
from draftline.core.sampling import SamplingParams
from draftline.core.spec import load_spec

SPECS = Path(__file__).parent.parent / "specs"
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Config:\n", "    return"]
PENALISED = {
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=1.2),
    "repetition": dict(repetition_penalty=1.3),
    "bias": dict(logit_bias=((282, -5.0), (13, 2.5))),
    "mixed": dict(frequency_penalty=0.4, presence_penalty=0.3, repetition_penalty=1.1, logit_bias=((290, 1.0),)),
}


@pytest.fixture(scope="module")
def plain():
    return Engine(load_spec(SPECS / "tiny-none.yaml"))


def _params(**kw):
    return SamplingParams(max_new_tokens=16, ignore_eos=True, **kw)


def _hand_decoder(engine, prompt, p):
    """Full forward each step, the penalties written out as vLLM defines them, argmax."""
    ids = engine.encode(prompt)
    prompt_len = len(ids)
    for _ in range(p.max_new_tokens):
        hidden, _ = full_forward(engine.target, torch.tensor([ids]))
        x = engine.target.logits(hidden[0, -1]).float()
        out = ids[prompt_len:]
        for tok in set(ids):
            if p.repetition_penalty != 1.0:
                x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
        for tok in set(out):
            x[tok] -= p.frequency_penalty * out.count(tok) + p.presence_penalty
        for tok, b in p.logit_bias:
            x[tok] += b
        if len(out) < p.min_new_tokens:
            x[list(engine.target.config.eos_token_ids)] = float("-inf")
        ids.append(int(x.argmax()))
    return ids[prompt_len:]


@pytest.mark.parametrize("name", ["frequency", "repetition", "mixed"])
def test_plain_decoding_applies_penalties_as_defined(plain, name):
    p = _params(**PENALISED[name])
    got = plain.generate(PROMPTS[:1], p)[0].output_ids
    assert got == _hand_decoder(plain, PROMPTS[0], p)
    assert got != plain.generate(PROMPTS[:1], _params())[0].output_ids  # the penalty changed something


def test_min_new_tokens_masks_eos_until_reached(plain):
    eos = plain.target.config.eos_token_ids[0]
    biased = dict(logit_bias=((eos, 100.0),))  # EOS would come first
    assert plain.generate(["x"], SamplingParams(max_new_tokens=8, **biased))[0].output_ids == [eos]
    out = plain.generate(["x"], SamplingParams(max_new_tokens=8, min_new_tokens=5, **biased))[0].output_ids
    assert len(out) == 6 and out[-1] == eos and eos not in out[:5]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("method", ["tiny-dflash.yaml", "tiny-eagle3.yaml"])
def test_greedy_with_drafting_equals_plain_when_penalised(plain, method, batch):
    drafted = Engine(load_spec(SPECS / method), plain.target, plain.tokenizer, draft_policy="always")
    accepted = 0
    for name in ("frequency", "bias", "mixed"):
        kw = PENALISED[name]
        params = [_params(**kw)] * batch
        want = [c.output_ids for c in plain.generate(PROMPTS[:batch], params)]
        got = drafted.generate(PROMPTS[:batch], params)
        assert [c.output_ids for c in got] == want, name
        accepted += sum(c.meta_info["spec_accepted_tokens"] for c in got)
    assert accepted > 0  # drafts were accepted, so the counts over accepted drafts were exercised


def test_seeded_sampling_with_drafting_equals_plain_when_penalised(plain):
    """Argmax drafts are accepted against the target's own keyed sample at each position, so a
    seeded penalised request emits the same tokens drafted or not."""
    drafted = Engine(argmax_drafts(load_spec(SPECS / "tiny-dflash.yaml")), plain.target, plain.tokenizer,
                     draft_policy="always")
    params = [_params(temperature=0.8, seed=31 + i, **PENALISED["mixed"]) for i in range(3)]
    got = drafted.generate(PROMPTS[:3], params)
    assert [c.output_ids for c in got] == [c.output_ids for c in plain.generate(PROMPTS[:3], params)]
    assert sum(c.meta_info["spec_accepted_tokens"] for c in got) > 0


def test_stop_strings_count_only_after_min_new_tokens(plain):
    free = plain.generate(PROMPTS[:1], _params())[0]
    first = free.text.index("\n") if "\n" in free.text else None
    assert first is not None and first < len(plain.tokenizer.decode(free.output_ids[:4]))  # a newline comes early
    early = plain.generate(PROMPTS[:1], SamplingParams(max_new_tokens=16, ignore_eos=True, stop=("\n",)))[0]
    assert early.text == free.text[:first] and early.meta_info["finish_reason"]["matched"] == "\n"
    late = plain.generate(PROMPTS[:1], SamplingParams(max_new_tokens=16, ignore_eos=True, stop=("\n",), min_new_tokens=4))[0]
    start = len(plain.tokenizer.decode(free.output_ids[:4]))
    cut = free.text.find("\n", start)
    assert late.text == (free.text if cut < 0 else free.text[:cut]) and len(late.output_ids) >= 4
    assert len(late.text) > len(early.text)
