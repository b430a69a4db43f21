"""A real uvicorn server on a free loopback port, driven over HTTP with httpx."""

import asyncio
import json
import logging
import re

import httpx
import pytest
import torch

from draftline.api.server import background
from conftest import tiny_spec
from draftline.core.engine import Engine

SPEC = tiny_spec(max_batch_size=16, max_model_len=256)


GREEDY = {"text": "def add(a, b):", "sampling_params": {"max_new_tokens": 16, "temperature": 0.0}}


class Tracebacks(logging.Handler):
    """Log records that carry an exception: the server log must have none."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record):
        if record.exc_info:
            self.seen.append(self.format(record))


@pytest.fixture(scope="module")
def tracebacks():
    handler = Tracebacks()
    logging.getLogger().addHandler(handler)
    yield handler.seen
    logging.getLogger().removeHandler(handler)


@pytest.fixture(scope="module")
def url(tracebacks):
    with background(SPEC) as base:
        before = httpx.post(base + "/generate", json=GREEDY, timeout=120).json()["output_ids"]
        yield base
        after = httpx.post(base + "/generate", json=GREEDY, timeout=120).json()["output_ids"]
        assert after == before, "the greedy baseline changed while the server ran"  # whatever the fuzzer sent


@pytest.fixture
def client(url):
    with httpx.Client(base_url=url, timeout=120) as c:
        yield c


def _gen(text, stream=False, **sampling):
    return {"text": text, "stream": stream, "sampling_params": {"max_new_tokens": 12, "ignore_eos": True, **sampling}}


def _sse(client, path, body):
    chunks = []
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    return [json.loads(c) for c in chunks[:-1]]


def _metric(text, name, labels=""):
    m = re.search(rf"^{re.escape(name + labels)} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_generate_and_stream_agree(client):
    body = _gen("def f(x):", temperature=0.8, sampling_seed=5)
    plain = client.post("/generate", json=body).json()
    assert plain["meta_info"]["completion_tokens"] == 12 and len(plain["output_ids"]) == 12
    chunks = _sse(client, "/generate", {**body, "stream": True})
    assert chunks[-1]["text"] == plain["text"] and chunks[-1]["output_ids"] == plain["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_openai_completions_and_stream(client):
    body = {"prompt": "import os\n", "max_tokens": 10, "temperature": 0.0}
    plain = client.post("/v1/completions", json=body).json()
    assert plain["object"] == "text_completion" and plain["choices"][0]["finish_reason"] == "length"
    assert plain["usage"]["completion_tokens"] == 10
    chunks = _sse(client, "/v1/completions", {**body, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    native = client.post("/generate", json={"text": "import os\n", "sampling_params": {"max_new_tokens": 10}}).json()
    assert native["text"] == plain["choices"][0]["text"]


def test_models_health_spec(client):
    assert client.get("/health").status_code == 200
    assert client.get("/v1/models").json()["data"][0]["id"] == "random-tiny-qwen3"
    spec = client.get("/spec").json()
    assert spec["plan"]["method"] == "dflash" and spec["plan"]["num_speculative_tokens"] == 15
    assert any(p.startswith("ACCEPT") for p in spec["phases"])
    cache = spec["prefix_cache"]  # the reference backend caches prefixes
    assert cache["block_size"] == 16 and cache["pinned_blocks"] <= cache["cached_blocks"] <= cache["capacity_blocks"]
    blocks = spec["kv_blocks"]  # unset num_kv_blocks: a whole context for every running request
    assert blocks["size"] == 16 and blocks["preemptions"] == 0
    assert blocks["total"] * 16 >= spec["spec"]["server"]["max_batch_size"] * spec["spec"]["model"]["max_model_len"]


def test_metrics_move_by_exactly_what_requests_did(client):
    before = client.get("/metrics").text
    outs = [client.post("/generate", json=_gen(p, max_new_tokens=n)).json() for p, n in [("ab", 5), ("xyz", 9)]]
    after = client.get("/metrics").text
    delta = lambda name, labels="": _metric(after, name, labels) - _metric(before, name, labels)  # noqa: E731
    meta = [o["meta_info"] for o in outs]
    assert delta("draftline:generation_tokens_total") == 14
    assert delta("draftline:prompt_tokens_total") == sum(m["prompt_tokens"] for m in meta)
    assert delta("draftline:prefix_cache_queries_total") == sum(m["prompt_tokens"] for m in meta)
    assert delta("draftline:prefix_cache_hits_total") == sum(m["cached_tokens"] for m in meta)
    assert delta("draftline:requests_total", '{finish_reason="length"}') == 2
    assert delta("draftline:spec_decode_num_verify_steps_total") == sum(m["spec_verify_ct"] for m in meta)
    assert delta("draftline:spec_decode_num_draft_tokens_total") == sum(m["spec_draft_tokens"] for m in meta)
    assert delta("draftline:spec_decode_num_accepted_tokens_total") == sum(m["spec_accepted_tokens"] for m in meta)
    assert delta("draftline:e2e_request_latency_seconds_count") == 2


def _load_requests():
    out = []
    for i in range(64):
        sampling = {"max_new_tokens": 4 + i % 13, "ignore_eos": True, "sampling_seed": 1000 + i}
        if i % 3:
            sampling |= {"temperature": [0.5, 1.0][i % 2], "top_k": [-1, 20][i % 2 == 0], "top_p": 0.9}
        out.append({"text": "def g(" + "a, " * (i % 7) + "z):", "speculative": i % 5 != 0, "sampling_params": sampling})
    return out


def test_64_concurrent_requests_equal_their_solo_runs(url, client):
    bodies = _load_requests()

    async def fire():
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            return await asyncio.gather(*(c.post("/generate", json=b) for b in bodies))

    together = [r.json() for r in asyncio.run(fire())]
    alone = [client.post("/generate", json=b).json() for b in bodies]
    assert all(t["meta_info"]["finish_reason"]["type"] == "length" for t in together)
    assert [t["output_ids"] for t in together] == [a["output_ids"] for a in alone]


def test_disconnect_mid_stream_frees_the_slot(url, client):
    before = _metric(client.get("/metrics").text, "draftline:requests_total", '{finish_reason="abort"}')

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            other = asyncio.create_task(c.post("/generate", json=_gen("other", max_new_tokens=30)))
            async with c.stream("POST", "/generate", json=_gen("long", stream=True, max_new_tokens=200)) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen == 3:
                        break  # leave mid-stream
            return await other

    other = asyncio.run(run())
    assert other.status_code == 200 and other.json()["meta_info"]["completion_tokens"] == 30
    for _ in range(100):
        health = client.get("/health").json()
        aborted = _metric(client.get("/metrics").text, "draftline:requests_total", '{finish_reason="abort"}')
        if health["running"] == 0 and aborted == before + 1:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert health["running"] == 0 and aborted == before + 1


@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "the body is not valid JSON"),
    ({"text": 5}, 400, "text: must be a string"),
    ({"text": "x", "sampling_params": {"max_new_tokens": -3}}, 400, "sampling_params.max_new_tokens"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 10**9}}, 400, "max_new_tokens"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 1000}}, 400, "exceeds max_model_len"),
    ({"text": ""}, 400, "prompt is empty"),
    ({"text": "x" * 300}, 400, "max_model_len is 256"),
    ({"text": "x", "colour": "red"}, 400, "colour: unknown field"),
    ({"text": "x", "input_ids": [1]}, 400, "exactly one of"),
    ({"input_ids": [1, 99999]}, 400, "input_ids must lie in"),
    ({"text": "x", "sampling_params": {"temperature": "hot"}}, 400, "temperature: must be a number"),
])
def test_bad_input_is_a_clear_4xx(client, body, status, needle):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = client.post("/generate", **kw)
    assert r.status_code == status and needle in r.json()["error"]["message"]
    assert client.get("/health").status_code == 200


def test_openai_bad_input(client):
    r = client.post("/v1/completions", json={"prompt": "x", "n": 99})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "server.max_n" in r.json()["error"]["message"]


def test_bearer_token(monkeypatch):
    monkeypatch.setenv("DRAFTLINE_TEST_TOKEN", "s3cret")
    spec = SPEC.model_copy(update={"server": SPEC.server.model_copy(update={"api_key_env": "DRAFTLINE_TEST_TOKEN"})})
    with background(spec) as base, httpx.Client(base_url=base, timeout=60) as c:
        assert c.post("/generate", json=_gen("x")).status_code == 401
        wrong = c.post("/generate", json=_gen("x"), headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "bearer token" in wrong.json()["error"]["message"]
        ok = c.post("/generate", json=_gen("x"), headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and c.get("/health").status_code == 200


def test_full_queue_is_503_with_retry_after():
    spec = SPEC.model_copy(update={"server": SPEC.server.model_copy(update={"max_queue": 1, "max_batch_size": 1})})

    async def flood(base):
        async with httpx.AsyncClient(base_url=base, timeout=120) as c:
            return await asyncio.gather(*(c.post("/generate", json=_gen("q", max_new_tokens=60)) for _ in range(12)))

    with background(spec) as base:
        codes = [r.status_code for r in asyncio.run(flood(base))]
        busy = [r for r in asyncio.run(flood(base)) if r.status_code == 503]
        assert 200 in codes and 503 in codes and set(codes) <= {200, 503}
        assert busy and busy[0].headers["retry-after"] == "1" and "max_queue" in busy[0].json()["error"]["message"]
        assert httpx.get(base + "/health").status_code == 200


def test_a_failing_request_ends_alone():
    """A token whose embedding is NaN poisons only the requests that contain it."""
    engine = Engine(SPEC)
    with torch.no_grad():
        engine.target.model.embed_tokens.weight[300] = float("nan")
    with background(SPEC, engine) as base, httpx.Client(base_url=base, timeout=60) as c:

        async def both():
            async with httpx.AsyncClient(base_url=base, timeout=60) as ac:
                bad = ac.post("/generate", json={"input_ids": [5, 300, 7], "sampling_params": {"max_new_tokens": 8}})
                good = ac.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8}})
                return await asyncio.gather(bad, good)

        bad, good = asyncio.run(both())
        assert bad.json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert "non-finite" in bad.json()["meta_info"]["finish_reason"]["message"]
        assert good.json()["meta_info"]["completion_tokens"] == 8
        assert c.get("/health").status_code == 200


schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402


@pytest.fixture(scope="module")
def api_schema(url):
    return schemathesis.openapi.from_url(url + "/openapi.json")


fuzzed = schemathesis.pytest.from_fixture("api_schema")


@fuzzed.parametrize()
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzzed_requests_never_break_the_server(case, client, tracebacks):
    """Schema-driven fuzzing, a bounded number of cases per operation: never a 5xx (the
    fuzzer sends one request at a time, so not even a full queue's 503), every error in
    OpenAI's shape, no traceback in the server's log, and the server stays healthy (the url
    fixture checks a greedy baseline before and after). The health checks share the client
    fixture's connection: a new httpx client a check built its TLS context (about 70 ms here),
    most of this test's time over its ~1,200 cases."""
    response = case.call(timeout=120)
    assert response.status_code < 500, response.text[:1000]
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}, response.text[:1000]
    assert not tracebacks, tracebacks[0]
    assert client.get("/health").status_code == 200


def test_engine_that_keeps_failing_reports_unhealthy():
    """A loop whose every step fails gives up after a few tries: each waiting client still
    gets an answer (an abort naming the error), new requests get 503, /health turns 503."""
    engine = Engine(SPEC)

    def broken_step():
        raise RuntimeError("simulated device fault")

    engine.machine.step = broken_step
    with background(SPEC, engine) as base, httpx.Client(base_url=base, timeout=60) as c:
        first = c.post("/generate", json=_gen("x")).json()
        assert first["meta_info"]["finish_reason"]["type"] == "abort"
        assert "simulated device fault" in first["meta_info"]["finish_reason"]["message"]
        for _ in range(10):
            r = c.post("/generate", json=_gen("x"))
            if r.status_code == 503:
                break
        assert r.status_code == 503 and c.get("/health").status_code == 503


def test_start_up_objects_are_frozen_while_serving_and_full_collections_are_counted():
    """core/collector.py: while a server runs, what start-up made is out of the collector's walk
    and /health counts the full collections; stopping the server unfreezes them."""
    import gc

    with background(SPEC) as base, httpx.Client(base_url=base, timeout=120) as c:
        assert gc.get_freeze_count() > 10_000  # modules, the engine, the app
        before = c.get("/health").json()["gc"]
        gc.collect()
        after = c.get("/health").json()["gc"]
        assert min(before["frozen_objects"], after["frozen_objects"]) > 10_000  # (frozen objects may still die by refcount)
        assert after["full_collections"] >= before["full_collections"] + 1 and after["longest_full_ms"] >= 0
        assert c.post("/generate", json=_gen("def f(x):\n", max_new_tokens=4)).status_code == 200
    assert gc.get_freeze_count() == 0
