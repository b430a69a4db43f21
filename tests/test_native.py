"""SGLang's /generate with the fields the OpenAI routes have: batches, n, logprobs, penalties."""

import json

import httpx
import pytest

from draftline.api.server import background
from conftest import tiny_spec

SPEC = tiny_spec(max_batch_size=8, max_model_len=128)


@pytest.fixture(scope="module")
def client():
    with background(SPEC) as base, httpx.Client(base_url=base, timeout=120) as c:
        yield c


def _gen(client, **body):
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_batched_text_and_ids_equal_single_requests(client):
    sp = {"max_new_tokens": 6, "ignore_eos": True}
    batch = _gen(client, text=["def f(x):", "import os"], sampling_params=sp)
    assert [b["index"] for b in batch] == [0, 1]
    assert [b["output_ids"] for b in batch] == [_gen(client, text=t, sampling_params=sp)["output_ids"]
                                               for t in ["def f(x):", "import os"]]
    ids = _gen(client, input_ids=[[5, 6, 7], [8]], sampling_params=sp)
    assert [b["meta_info"]["prompt_tokens"] for b in ids] == [3, 1]
    two = _gen(client, text="x", sampling_params=sp | {"n": 2, "temperature": 1.0, "sampling_seed": 4})
    assert len(two) == 2 and two[0]["output_ids"] != two[1]["output_ids"]
    assert [t["meta_info"]["seed"] for t in two] == [4, 5]  # choice j replays with seed + j


def test_return_logprob_fields(client):
    r = _gen(client, input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 4, "ignore_eos": True},
             return_logprob=True, top_logprobs_num=2, logprob_start_len=1)
    m = r["meta_info"]
    assert [t[1] for t in m["output_token_logprobs"]] == r["output_ids"]
    assert [t[1] for t in m["input_token_logprobs"]] == [6, 7, 8] and all(t[0] < 0 for t in m["input_token_logprobs"])
    assert all(len(top) == 2 and top[0][0] >= top[1][0] for top in m["output_top_logprobs"] + m["input_top_logprobs"])
    greedy = [t[1] for t in m["output_token_logprobs"]]
    assert [top[0][1] for top in m["output_top_logprobs"]] == greedy  # greedy picks each position's top token


def test_penalties_and_min_new_tokens(client):
    sp = {"max_new_tokens": 12, "ignore_eos": True}
    plain = _gen(client, text="aaaa", sampling_params=sp)["output_ids"]
    penalised = _gen(client, text="aaaa", sampling_params=sp | {"frequency_penalty": 2.0, "repetition_penalty": 1.5})
    assert penalised["output_ids"] != plain
    first = plain[0]
    stopped = _gen(client, text="aaaa", sampling_params={"max_new_tokens": 12, "stop_token_ids": [first]})
    assert stopped["output_ids"] == [first]
    late = _gen(client, text="aaaa", sampling_params={"max_new_tokens": 12, "stop_token_ids": [first],
                                                      "min_new_tokens": 4, "ignore_eos": True})
    assert len(late["output_ids"]) >= 4 and first not in late["output_ids"][:4]


def test_streamed_batch_ends_with_each_prompts_result(client):
    body = {"text": ["def f(x):", "import os"], "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    plain = _gen(client, **body)
    finals = {}
    with client.stream("POST", "/generate", json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["meta_info"]["finish_reason"] is not None:
                    finals[chunk["index"]] = chunk["output_ids"]
    assert finals == {p["index"]: p["output_ids"] for p in plain}
