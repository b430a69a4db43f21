"""Bad and hostile requests against a real server: each is a 4xx in OpenAI's error shape that
names the field and the fix, never a 5xx, never echoing the rejected value, checked before any
work; a client that leaves frees its slot; auth holds on every route but /health."""

import asyncio
import json
import re

import httpx
import pytest

from conftest import tiny_spec
from draftline.api.server import background
from draftline.core.models.config import ConfigError

BASE = tiny_spec(max_batch_size=4, max_model_len=256)
SERVER = {"max_queue": 8, "max_request_bytes": 65536, "max_prompt_chars": 2000, "max_stop_strings": 4,
          "max_stop_chars": 64, "max_n": 4, "max_logit_bias": 8, "served_model_name": ["tiny", "alias"]}
SPEC = BASE.model_copy(update={"server": BASE.server.model_copy(update=SERVER)})
ROUTES = {"/generate": "sampling_params.", "/v1/completions": "", "/v1/chat/completions": ""}


@pytest.fixture(scope="module")
def url():
    with background(SPEC) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    with httpx.Client(base_url=url, timeout=120) as c:
        yield c


def _body(path: str, **fields) -> dict:
    """A valid request to ``path`` with ``fields`` set where that route takes them."""
    if path == "/generate":
        return {"text": "def f(x):", "sampling_params": {"max_new_tokens": 4, **fields}}
    if path == "/v1/completions":
        return {"prompt": "def f(x):", "max_tokens": 4, **fields}
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def _post_raw(client, path: str, text: str) -> httpx.Response:
    """The body as text: Python's json writes NaN and Infinity bare, as `requests` sends them."""
    return client.post(path, content=text.encode(), headers={"content-type": "application/json"})


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_infinity_are_a_400_naming_the_field(client, path, field, value):
    err = _error(_post_raw(client, path, json.dumps(_body(path, **{field: value}))), 400)
    assert err["param"] == ROUTES[path] + field and "finite number" in err["message"]
    assert client.get("/health").status_code == 200


def test_nan_in_logit_bias_and_in_a_list_prompt(client):
    err = _error(_post_raw(client, "/v1/completions", json.dumps(_body("/v1/completions", logit_bias={"5": float("nan")}))), 400)
    assert err["param"] == "logit_bias.5" and "finite" in err["message"]
    err = _error(_post_raw(client, "/v1/completions", json.dumps({"prompt": [1, float("nan")]})), 400)
    assert err["param"].startswith("prompt")


@pytest.mark.parametrize("path, fields, param", [
    ("/generate", {"stream": "yes"}, "stream"),
    ("/v1/completions", {"stream": "yes"}, "stream"),
    ("/v1/completions", {"max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"n": "2"}, "n"),
    ("/v1/completions", {"echo": 1}, "echo"),
    ("/v1/completions", {"temperature": True}, "temperature"),
    ("/v1/chat/completions", {"logprobs": "true"}, "logprobs"),
    ("/v1/chat/completions", {"max_completion_tokens": 2.5}, "max_completion_tokens"),
])
def test_types_are_strict(client, path, fields, param):
    body = _body(path) | fields
    err = _error(client.post(path, json=body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_a_rejected_value_is_never_echoed(client):
    huge = "z" * 60_000  # under max_request_bytes: refused by its type, not its size
    for body in ({"prompt": "x", "temperature": huge}, {"prompt": "x", huge: 1}, {"prompt": {"a": huge}}):
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400 and len(r.content) < 1000 and "zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz" not in r.text


def test_not_json_not_an_object_and_unknown_routes(client):
    assert "not valid JSON" in _error(_post_raw(client, "/generate", "{nope"), 400)["message"]
    assert "JSON object" in _error(_post_raw(client, "/generate", "[1, 2]"), 400)["message"]
    assert _error(client.get("/v2/anything"), 404)["type"] == "not_found_error"
    assert _error(client.put("/generate"), 405)["message"].startswith("method not allowed")


def test_body_over_the_limit_is_a_413_unread(client):
    big = json.dumps({"text": "x" * 100_000}).encode()
    err = _error(client.post("/generate", content=big, headers={"content-type": "application/json"}), 413)
    assert "server.max_request_bytes (65,536)" in err["message"]
    chunks = (big[i:i + 8192] for i in range(0, len(big), 8192))  # no Content-Length: counted as it arrives
    _error(client.post("/generate", content=chunks, headers={"content-type": "application/json"}), 413)
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("path, body, param, needle", [
    ("/generate", {"text": "x" * 2001}, "text", "server.max_prompt_chars (2,000)"),
    ("/generate", {"input_ids": [5] * 300}, "input_ids", "max_model_len is 256"),
    ("/v1/completions", {"prompt": ["ab", "x" * 2001]}, "prompt.1", "server.max_prompt_chars"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 2001}]}, "messages", "max_prompt_chars"),
    ("/generate", {"text": "x", "sampling_params": {"stop": ["a"] * 5}}, "sampling_params.stop", "server.max_stop_strings (4)"),
    ("/v1/completions", {"prompt": "x", "stop": "s" * 65}, "stop", "server.max_stop_chars (64)"),
    ("/v1/completions", {"prompt": "x", "n": 5}, "n", "server.max_n (4)"),
    ("/v1/completions", {"prompt": "x", "best_of": 5}, "best_of", "server.max_n (4)"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(9)}}, "logit_bias",
     "server.max_logit_bias (8)"),
    ("/v1/completions", {"prompt": ["a"] * 3, "n": 3}, "prompt", "more than server.max_queue (8) ever holds"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4o"}, "model", "does not exist"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "x" * 500}, "model",
     "does not exist"),
])
def test_limits_are_checked_before_any_work(client, path, body, param, needle):
    status = 404 if param == "model" else 400
    err = _error(client.post(path, json=body), status)
    assert err["param"] == param and needle in err["message"]
    assert len(err["message"]) < 400


def test_served_names_and_aliases(client):
    listed = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in listed] == ["tiny", "alias"] and all(m["created"] > 0 for m in listed)
    assert client.get("/v1/models/alias").json()["id"] == "alias"
    assert _error(client.get("/v1/models/other"), 404)["param"] == "model"
    for name in ("tiny", "alias", None):
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2} | ({"model": name} if name else {}))
        assert r.status_code == 200 and r.json()["model"] == (name or "tiny")


def _running_and_aborted(client) -> tuple[int, float]:
    metrics = client.get("/metrics").text
    m = re.search(r'^draftline:requests_total\{finish_reason="abort"\} ([0-9.e+]+)$', metrics, re.M)
    return client.get("/health").json()["running"], float(m.group(1)) if m else 0.0


def test_non_streaming_clients_that_leave_free_their_slots(url, client):
    """Clients that time out (as the openai client does) cancel their requests: the slots are
    free within a step or two of the disconnects, not after the requests' 200 tokens."""
    _, before = _running_and_aborted(client)
    body = {"text": "def f(x):", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}

    async def impatient():
        async with httpx.AsyncClient(base_url=url, timeout=0.5) as c:
            return await asyncio.gather(*(c.post("/generate", json=body) for _ in range(4)), return_exceptions=True)

    results = asyncio.run(impatient())
    assert all(isinstance(r, httpx.TimeoutException) for r in results)
    for _ in range(100):
        running, aborted = _running_and_aborted(client)
        if running == 0 and aborted == before + 4:
            break
        asyncio.run(asyncio.sleep(0.02))
    assert running == 0 and aborted == before + 4


def test_auth_guards_every_route_but_health(monkeypatch):
    monkeypatch.setenv("DRAFTLINE_TEST_KEY", "s3cret")
    spec = BASE.model_copy(update={"server": BASE.server.model_copy(update={"api_key_env": "DRAFTLINE_TEST_KEY"})})
    with background(spec) as base, httpx.Client(base_url=base, timeout=60) as c:
        for method, path in [("GET", "/metrics"), ("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/spec"),
                             ("GET", "/v1/models"), ("GET", "/v1/models/x"), ("GET", "/nope"), ("POST", "/generate")]:
            r = c.request(method, path)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
            assert _error(r, 401)["type"] == "authentication_error"
        assert c.get("/health").status_code == 200
        for header in ("Bearer nope", "Bearer", "Basic s3cret", "s3cret", "Bearer s3cretX"):
            assert c.get("/v1/models", headers={"Authorization": header}).status_code == 401, header
        for header in ("Bearer s3cret", "bearer s3cret", "BEARER  s3cret"):
            assert c.get("/v1/models", headers={"Authorization": header}).status_code == 200, header


@pytest.mark.parametrize("value", [None, "", "   "])
def test_a_configured_key_that_is_unset_or_empty_refuses_to_start(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("DRAFTLINE_TEST_KEY", raising=False)
    else:
        monkeypatch.setenv("DRAFTLINE_TEST_KEY", value)
    spec = BASE.model_copy(update={"server": BASE.server.model_copy(update={"api_key_env": "DRAFTLINE_TEST_KEY"})})
    with pytest.raises(ConfigError, match="server.api_key_env names DRAFTLINE_TEST_KEY, which is (not set|empty)"):
        with background(spec):
            pass
