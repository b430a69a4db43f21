"""The real openai client against a real server on a loopback port (the shipped tiny pair)."""

from pathlib import Path

import httpx
import openai
import pytest
import torch

from draftline.api.server import background
from conftest import full_forward
from draftline.core.spec import load_spec

SPECS = Path(__file__).parent.parent / "specs"
# spec defaults every request inherits: 9 new tokens, EOS ignored
SPEC = load_spec(SPECS / "tiny-dflash.yaml")
_DATA = SPEC.model_dump()
_DATA["model"]["max_model_len"] = 64
_DATA["server"]["served_model_name"] = ["tiny-code", "m"]  # requests below name it by its alias, m
# argmax drafts: a seeded request's tokens then follow from its seed alone, whatever its neighbours
# and however many rounds draft (sampled drafts are lossless in law, not token for token)
_DATA["speculative"]["draft_sample_method"] = "greedy"
SPEC = type(SPEC).model_validate(_DATA | {"sampling": {"max_new_tokens": 9, "ignore_eos": True}})


def test_spec_defaults_apply_and_unseeded_requests_differ(client, url):
    plain = client.completions.create(model="m", prompt="def f(x):")
    assert plain.usage.completion_tokens == 9 and plain.choices[0].finish_reason == "length"  # the spec's defaults
    assert client.completions.create(model="m", prompt="def f(x):").choices[0].text == plain.choices[0].text  # greedy
    unseeded = [client.completions.create(model="m", prompt="def f(x):", temperature=1.0).choices[0].text
                for _ in range(2)]
    assert unseeded[0] != unseeded[1]
    sampled = [httpx.post(url + "/generate", json={"text": "def f(x):", "sampling_params": {"temperature": 1.0}}).json()
               for _ in range(2)]
    assert sampled[0]["output_ids"] != sampled[1]["output_ids"]
    seed = sampled[0]["meta_info"]["seed"]  # reported, so the request replays
    replay = httpx.post(url + "/generate", json={"text": "def f(x):",
                                                 "sampling_params": {"temperature": 1.0, "sampling_seed": seed}}).json()
    assert replay["output_ids"] == sampled[0]["output_ids"] and replay["meta_info"]["seed"] == seed


def test_models_are_listed_retrieved_and_an_unknown_one_is_a_404(client):
    listed = client.models.list().data
    assert [m.id for m in listed] == ["tiny-code", "m"] and all(m.created > 0 for m in listed)
    assert client.models.retrieve("m").id == "m"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4o")
    with pytest.raises(openai.NotFoundError, match="serves 'tiny-code', 'm'"):
        client.completions.create(model="gpt-4o", prompt="def f(x):")
    assert client.completions.create(model="tiny-code", prompt="def f(x):").model == "tiny-code"


def test_streamed_equals_plain_with_usage_chunk(client):
    kw = dict(model="m", prompt="import os\n", max_tokens=12, temperature=0.9, seed=11)
    plain = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == plain.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_n_and_list_prompts(client):
    kw = dict(model="m", max_tokens=8, temperature=1.0, seed=3)
    two = client.completions.create(prompt="def f(x):", n=2, **kw)
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].text != two.choices[1].text
    assert [c.text for c in client.completions.create(prompt="def f(x):", n=2, **kw).choices] == [
        c.text for c in two.choices]  # seeded: the same choices again
    texts = client.completions.create(prompt=["def f(x):", "class A:"], **kw)
    ids = client.completions.create(prompt=[[5, 6, 7], [8, 9]], **kw)
    assert [c.index for c in texts.choices] == [0, 1] and [c.index for c in ids.choices] == [0, 1]
    assert texts.choices[0].text == two.choices[0].text  # a prompt's first choice, whatever its neighbours
    assert ids.usage.prompt_tokens == 5 and ids.usage.completion_tokens == 16
    best = client.completions.create(prompt="def f(x):", n=1, best_of=3, logprobs=0, **kw)
    assert len(best.choices) == 1 and best.usage.completion_tokens == 24


def test_logprobs_are_the_targets_and_echo_gives_the_prompts(client, engine, url):
    r = client.completions.create(model="m", prompt="def f(x):\n", max_tokens=6, logprobs=3, echo=True, temperature=0)
    lp = r.choices[0].logprobs
    ids = engine.encode("def f(x):\n")
    n = len(ids)
    assert r.choices[0].text.startswith("def f(x):\n") and lp.token_logprobs[0] is None and len(lp.tokens) == n + 6
    # the greedy ids through the server: the test never steps the engine its loop thread steps
    out = httpx.post(url + "/generate", json={"text": "def f(x):\n", "sampling_params": {
        "max_new_tokens": 6, "temperature": 0}}, timeout=120).json()["output_ids"]
    with torch.no_grad():
        hidden, _ = full_forward(engine.target, torch.tensor([ids + out]))
        want = torch.log_softmax(engine.target.logits(hidden[0]).float(), -1)  # [n+6, V]
    full = ids + out
    for t in range(1, n + 6):
        assert lp.token_logprobs[t] == pytest.approx(float(want[t - 1, full[t]]), abs=1e-4)
        assert len(lp.top_logprobs[t]) >= 3 and max(lp.top_logprobs[t].values()) == pytest.approx(
            float(want[t - 1].max()), abs=1e-4)
    only = client.completions.create(model="m", prompt=[ids], max_tokens=0, logprobs=1, echo=True)
    assert only.usage.completion_tokens == 0 and only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n]


def test_max_tokens_null_min_tokens_stop_ids_penalties(client, engine):
    rest = client.completions.create(model="m", prompt=[[5, 6]], max_tokens=None, extra_body={"max_tokens": None})
    assert rest.usage.completion_tokens == SPEC.model.max_model_len - 2
    kw = dict(model="m", prompt="def f(x):", max_tokens=10)
    plain = client.completions.create(**kw)
    penalised = client.completions.create(**kw, frequency_penalty=1.5, presence_penalty=0.5, logit_bias={"282": -100})
    assert penalised.choices[0].text != plain.choices[0].text
    first = engine.encode(plain.choices[0].text)[0]
    stopped = client.completions.create(**kw, extra_body={"stop_token_ids": [first], "ignore_eos": False})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    late = client.completions.create(**kw, extra_body={"stop_token_ids": [first], "min_tokens": 3})
    assert late.usage.completion_tokens >= 3


@pytest.mark.parametrize("field, value", [("suffix", "x")])
def test_unimplemented_openai_fields_are_a_400_naming_them(client, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt="x", **{field: value})
    assert info.value.status_code == 400 and field in info.value.message


CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]


def test_hf_reads_the_shipped_tokenizer_and_template_as_draftline_does(client, engine):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(SPECS / "tiny" / "target")
    for text in ["def f(x):\n    return x  # héllo<|endoftext|>\n\n", "  a\n\n\n b\t\tc  ", "日本語 ✓"]:
        assert hf.encode(text) == engine.tokenizer.encode(text).ids
    ids = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    chat = client.chat.completions.create(model="m", messages=CHAT, max_tokens=10)
    plain = client.completions.create(model="m", prompt=[ids], max_tokens=10)
    assert chat.choices[0].message.content == plain.choices[0].text and chat.usage.prompt_tokens == len(ids)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"


def test_chat_streamed_equals_plain_with_logprobs(client):
    kw = dict(model="m", messages=CHAT, max_completion_tokens=8, temperature=0.7, seed=2, n=2, logprobs=True, top_logprobs=2)
    plain = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    for i, choice in enumerate(plain.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        streamed = [e for c in mine if c.logprobs for e in c.logprobs.content]
        # equal up to float32 rounding: a position verified in a drafting window computes with other shapes
        assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in choice.logprobs.content], abs=1e-4)
        assert len(choice.logprobs.content) == 8 and all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
    assert plain.choices[0].message.content != plain.choices[1].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


@pytest.mark.parametrize("field, value", [
    ("audio", {"voice": "alloy", "format": "wav"}), ("reasoning_effort", "high"),
    ("prediction", {"type": "content", "content": "x"}), ("function_call", "auto"), ("functions", [{"name": "f"}]),
    ("modalities", ["text", "audio"]), ("service_tier", "flex"), ("store", True), ("metadata", {"k": "v"}),
    ("web_search_options", {"search_context_size": "low"}), ("verbosity", "low"),
])
def test_unimplemented_chat_fields_are_a_400_naming_them(client, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=CHAT, extra_body={field: value})
    assert info.value.status_code == 400 and field in info.value.message


def test_every_implemented_field_at_once_is_accepted(client):
    common = dict(model="m", n=2, stop=["zzz"], seed=1, temperature=0.5, top_p=0.9, presence_penalty=0.1,
                  frequency_penalty=0.1, logit_bias={"5": 1.0}, user="u", stream_options=None)
    extra = dict(top_k=20, min_tokens=1, repetition_penalty=1.1, ignore_eos=True, stop_token_ids=[3])
    r = client.completions.create(prompt="def f(x):", max_tokens=3, echo=True, logprobs=2, best_of=3, **common,
                                  extra_body=extra)
    assert len(r.choices) == 2
    c = client.chat.completions.create(messages=CHAT, max_completion_tokens=3, logprobs=True, top_logprobs=2, **common,
                                       extra_body=extra | {"add_generation_prompt": True})
    assert len(c.choices) == 2


def test_harmless_defaults_of_unimplemented_fields_are_accepted(client):
    r = client.chat.completions.create(model="m", messages=CHAT, max_tokens=2, response_format={"type": "text"},
                                       store=False, tool_choice="none", user="u", modalities=["text"])
    assert r.usage.completion_tokens == 2


def test_a_checkpoint_without_a_template_is_a_clear_400():
    from conftest import tiny_spec
    with background(tiny_spec()) as base:
        r = httpx.post(base + "/v1/chat/completions", json={"messages": CHAT})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def test_streamed_list_prompts_with_n_and_echo_equal_plain(client):
    kw = dict(model="m", prompt=["def f(x):", "class A:"], n=2, max_tokens=6, temperature=0.8, seed=9, echo=True,
              logprobs=1)
    plain = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    assert len(plain.choices) == 4
    for choice in plain.choices:
        mine = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text and mine[-1].finish_reason == "length"
        streamed = [lp for c in mine for lp in c.logprobs.token_logprobs]
        assert streamed[0] is None and streamed[1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-4)


def test_every_choice_reports_the_seed_that_replays_it(client):
    kw = dict(model="m", prompt="def f(x):", max_tokens=6, temperature=1.0)
    unseeded = client.completions.create(**kw, n=2)
    seeds = [c.seed for c in unseeded.choices]
    assert all(isinstance(s, int) for s in seeds) and seeds[0] != seeds[1]
    for choice in unseeded.choices:  # each choice alone, from its reported seed
        assert client.completions.create(**kw, seed=choice.seed).choices[0].text == choice.text
    chunks = list(client.completions.create(**kw, seed=seeds[1], stream=True))
    assert {c.choices[0].seed for c in chunks} == {seeds[1]}
    assert "".join(c.choices[0].text for c in chunks) == unseeded.choices[1].text
    chat = dict(model="m", messages=CHAT, max_completion_tokens=5, temperature=1.0)
    plain = client.chat.completions.create(**chat)
    assert client.chat.completions.create(**chat, seed=plain.choices[0].seed).choices[0].message.content == \
        plain.choices[0].message.content
    streamed = [c for c in client.chat.completions.create(**chat, seed=plain.choices[0].seed, stream=True) if c.choices]
    assert {c.choices[0].seed for c in streamed} == {plain.choices[0].seed}
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == plain.choices[0].message.content


def test_chat_template_controls_render_as_transformers_does(client):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(SPECS / "tiny" / "target")
    started = CHAT + [{"role": "assistant", "content": "    return a"}]
    for messages, kw, extra in [
        (started, {"continue_final_message": True, "add_generation_prompt": False},
         {"continue_final_message": True, "add_generation_prompt": False}),
        (CHAT, {"add_generation_prompt": False}, {"chat_template_kwargs": {"add_generation_prompt": False}}),
    ]:
        ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)
        chat = client.chat.completions.create(model="m", messages=messages, max_tokens=6, extra_body=extra)
        plain = client.completions.create(model="m", prompt=[ids], max_tokens=6)
        assert chat.usage.prompt_tokens == len(ids) and chat.choices[0].message.content == plain.choices[0].text
    parts = [{"role": "user", "content": [{"type": "text", "text": "def add(a, b):"}, {"type": "text", "text": "x"}]}]
    joined = [{"role": "user", "content": "def add(a, b):\nx"}]
    assert client.chat.completions.create(model="m", messages=parts, max_tokens=4).usage.prompt_tokens == \
        client.chat.completions.create(model="m", messages=joined, max_tokens=4).usage.prompt_tokens


@pytest.mark.parametrize("messages, extra, needle", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}], {}, "image_url"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}], {},
     "input_audio"),
    (CHAT, {"continue_final_message": True}, "add_generation_prompt"),
    (CHAT, {"chat_template_kwargs": {"messages": []}}, "messages"),
])
def test_chat_content_and_template_misuse_is_a_400_naming_it(client, messages, extra, needle):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=messages, max_tokens=2, extra_body=extra)
    assert info.value.status_code == 400 and needle in info.value.message


def test_template_variables_from_chat_template_kwargs():
    from draftline.core.models.chat_template import ChatTemplate, ChatTemplateError
    t = ChatTemplate("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if not loop.last %}</>\n"
                     "{% endif %}{% endfor %}{% if style %}[{{ style }}]{% endif %}")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "he said "}]
    assert t.render(msgs, style="terse") == "<user>hi</>\n<assistant>he said [terse]"
    assert t.render(msgs, continue_final_message=True, style=None) == "<user>hi</>\n<assistant>he said "
    with pytest.raises(ChatTemplateError, match="does not render"):
        ChatTemplate("{{ messages | length }}").render(msgs, continue_final_message=True)


def test_usage_reports_the_prompt_tokens_the_prefix_cache_gave(client):
    prompt = list(range(40, 80))  # 40 tokens: two full blocks of 16 to reuse
    first = client.completions.create(model="m", prompt=prompt, max_tokens=2)
    again = client.completions.create(model="m", prompt=prompt, max_tokens=2, stream=True,
                                      stream_options={"include_usage": True})
    last = list(again)[-1]
    messages = [{"role": "user", "content": "def read(path):\n    return open(path).read()\n"}]
    client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens in (0, 32)  # an earlier test may have sent it
    assert last.usage.prompt_tokens_details.cached_tokens == 32 and last.usage.prompt_tokens == 40
    n = chat.usage.prompt_tokens  # every full block before the last token
    assert n > 16 and chat.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
