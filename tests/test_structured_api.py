"""Structured outputs and tool calls through the real openai client against a served tiny
DFlash pair that drafts every round: JSON that validates and equals constrained plain decoding,
named and required tool calls, streamed tool-call deltas, and each bad input a 400."""

import json
from pathlib import Path

import httpx
import jsonschema
import pytest

from draftline.api.tools import ToolPlan, ToolStream, hermes
from draftline.core.engine import Engine
from draftline.core.grammar import Constraint
from draftline.core.sampling import SamplingParams
from draftline.core.spec import load_spec

pytest.importorskip("xgrammar", reason="structured outputs need the `structured` extra (xgrammar)")

SPECS = Path(__file__).parent.parent / "specs"
_DATA = load_spec(SPECS / "tiny-dflash.yaml").model_dump()
_DATA["speculative"]["max_draft_batch"] = "always"  # every round drafts: the grammar meets drafts each round
_DATA["model"]["max_model_len"] = 512
_DATA["server"]["served_model_name"] = ["x"]
SPEC = type(load_spec(SPECS / "tiny-dflash.yaml")).model_validate(_DATA | {"sampling": {"max_new_tokens": 160}})
SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 16}, "kind": {"enum": ["bug", "feature"]},
                   "labels": {"type": "array", "items": {"enum": ["ui", "core", "docs"]}, "maxItems": 2},
                   "meta": {"type": "object", "properties": {"urgent": {"type": "boolean"}}, "required": ["urgent"],
                            "additionalProperties": False}},
    "required": ["title", "kind", "labels", "meta"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                     "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "maximum": 12,
                                                                              "minimum": -12}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Rome?"}]


def test_json_schema_validates_and_equals_constrained_plain_decoding(client, engine):
    fmt = {"type": "json_schema", "json_schema": {"name": "issue", "schema": SCHEMA, "strict": True}}
    plain = Engine(load_spec(SPECS / "tiny-none.yaml"), engine.target, engine.tokenizer)
    params = SamplingParams(max_new_tokens=160, constraint=Constraint("json_schema", json.dumps(SCHEMA)))
    prompts = ["def parse(line):", "# file an issue\n", "class Bug:\n", "import json\n"]
    for prompt in prompts:
        got = client.chat.completions.create(model="x", messages=[{"role": "user", "content": prompt}],
                                             response_format=fmt)
        text = got.choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)
        assert got.choices[0].finish_reason == "stop"
        rendered = engine.chat_template.render([{"role": "user", "content": prompt}])
        assert text == plain.generate([rendered], params)[0].text


def test_every_api_spells_a_constraint(client, url):
    chat = client.chat.completions.create(model="x", messages=ASK, extra_body={"guided_choice": ["sunny", "rainy"]})
    assert chat.choices[0].message.content in ("sunny", "rainy")
    done = client.completions.create(model="x", prompt="x = ", extra_body={"guided_regex": "[0-9]{2,4}"})
    assert done.choices[0].text.isdigit() and 2 <= len(done.choices[0].text) <= 4
    vllm = client.completions.create(model="x", prompt="ok: ",
                                     extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert vllm.choices[0].text in ("yes", "no")
    native = httpx.post(url + "/generate", json={"text": "# json\n", "sampling_params": {
        "json_schema": json.dumps(SCHEMA), "max_new_tokens": 160}}).json()
    jsonschema.validate(json.loads(native["text"]), SCHEMA)
    assert native["meta_info"]["grammar_compile_ms"] >= 0 and "grammar_refused_drafts" in native["meta_info"]


def test_a_named_tool_call_returns_arguments_that_validate(client):
    got = client.chat.completions.create(model="x", messages=ASK, tools=[WEATHER, TIME],
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_tool_calls_each_validate(client):
    got = client.chat.completions.create(model="x", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                         max_tokens=200)
    calls = got.choices[0].message.tool_calls
    assert got.choices[0].finish_reason == "tool_calls" and calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_streamed_named_call_deltas_add_up_to_the_call(client):
    kw = dict(model="x", messages=ASK, tools=[WEATHER],
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert len(deltas) > 2  # the arguments stream as they are made
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_parses_calls_the_model_writes_and_streams_them(client):
    """tool_choice auto: what the model writes in its template's <tool_call> format comes back as
    calls (a regex makes the tiny model write one), streamed after the content before it."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>'
    kw = dict(model="x", messages=ASK, tools=[WEATHER], extra_body={"guided_regex": "Let me check\\. " + _regex(call)})
    got = client.chat.completions.create(**kw).choices[0]
    assert got.finish_reason == "tool_calls" and got.message.content == "Let me check."
    assert got.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(got.message.tool_calls[0].function.arguments) == {"city": "Oslo", "unit": "C"}
    chunks = list(client.chat.completions.create(**kw, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert content.strip() == "Let me check." and "<tool_call" not in content
    assert [d.function.name for d in calls] == ["get_weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def _regex(text: str) -> str:
    return "".join("\\" + ch if ch in "{}[]().*+?|^$\\" else ch for ch in text).replace("\n", "\\n")


@pytest.mark.parametrize("body, named", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tool_choice": "required"}, "no `tools`"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "share a name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strang"}}}},
     "does not compile"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "one structured-output constraint"),
    ({"guided_regex": "([a-z"}, "regex"),
    ({"guided_grammar": "root ::= missing"}, "grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_each_bad_input_is_a_400_naming_it(url, body, named):
    got = httpx.post(url + "/v1/chat/completions", json={"messages": ASK} | body, timeout=60)
    assert got.status_code == 400, got.text
    assert named in got.json()["error"]["message"]


def test_the_hermes_parser_and_its_stream():
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n' \
           '{"name": "g", "arguments": {}}\n</tool_call>'
    content, calls = hermes(text)
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {})]
    assert hermes("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    plan = ToolPlan((WEATHER,), "auto")
    stream, sent = ToolStream(plan), []
    for end in range(1, len(text)):  # fed one character at a time
        sent += stream.feed(text[:end])
    last, called = stream.finish(text)
    streamed = "".join(d.get("content", "") for d in sent + last)
    assert called and streamed == "Sure.\n" and "<" not in streamed
    assert [c["function"]["name"] for c in last[-1]["tool_calls"]] == ["f", "g"]
    one = ToolPlan((WEATHER,), "auto", parallel=False)
    assert len(one.parse(text)[1]) == 1
