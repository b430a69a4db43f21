"""`draftline bench-serve`: the real server under concurrent streaming load, drafting on and off."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from statistics import mean

import httpx

from draftline.core.engine import Engine
from draftline.core.spec import Spec
from draftline.core.training.corpus import read_prompts

from .server import background

PROMPTS = Path(__file__).resolve().parent.parent / "specs" / "tiny" / "eval_prompts.jsonl"


async def _one(client: httpx.AsyncClient, prompt: str, max_new: int, speculative: bool) -> dict:
    body = {"text": prompt, "stream": True, "speculative": speculative,
            "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}}
    start, first, last = time.perf_counter(), None, None
    async with client.stream("POST", "/generate", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if first is None and chunk["output_ids"]:
                    first = time.perf_counter()
                last = chunk
    end = time.perf_counter()
    reason = (last or {}).get("meta_info", {}).get("finish_reason") or {}
    if first is None or reason.get("type") == "abort":  # a benchmark of failed requests measures nothing
        raise RuntimeError(f"bench-serve: a request failed ({reason.get('message', 'no tokens streamed')}); "
                           "the server's log names the cause")
    n = last["meta_info"]["completion_tokens"]
    return {"ttft": first - start, "tpot": (end - first) / max(1, n - 1), "tokens": n,
            "tau": last["meta_info"]["spec_accept_length"], "start": start, "end": end}


async def _level(url: str, prompts: list[str], concurrency: int, count: int, max_new: int, speculative: bool) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(count):
        queue.put_nowait(prompts[i % len(prompts)])
    results: list[dict] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            results.append(await _one(client, queue.get_nowait(), max_new, speculative))

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "requests": count, "req_per_s": round(count / wall, 2),
            "out_tok_per_s": round(sum(r["tokens"] for r in results) / wall, 1),
            "ttft_ms": round(1e3 * mean(r["ttft"] for r in results), 1),
            "tpot_ms": round(1e3 * mean(r["tpot"] for r in results), 2),
            "tau": round(mean(r["tau"] for r in results), 2)}


def run_bench(spec: Spec, levels: list[int], requests: int, max_new: int, as_json: bool) -> str:
    prompts = read_prompts(PROMPTS) if PROMPTS.is_file() else ["def main():\n"]
    spec = spec.model_copy(update={"server": spec.server.model_copy(update={"max_batch_size": max(levels)})})
    modes = [("always", "always", True), ("auto", "auto", True), ("off", "auto", False)]
    rows, target = [], None
    for name, policy, speculative in modes:
        engine = Engine(spec, target[0], target[1], draft_policy=policy) if target else Engine(spec, draft_policy=policy)
        target = (engine.target, engine.tokenizer)
        with background(spec, engine) as url:
            asyncio.run(_level(url, prompts, 1, 2, 8, speculative))  # warm-up
            for c in levels:
                row = asyncio.run(_level(url, prompts, c, requests or max(8, 2 * c), max_new, speculative))
                rows.append({"drafting": name, **row})
    if as_json:
        return json.dumps(rows)
    head = f"{'drafting':>8} {'conc':>5} {'reqs':>5} {'req/s':>7} {'out tok/s':>10} {'TTFT ms':>8} {'TPOT ms':>8} {'tau':>5}"
    lines = [head] + [
        f"{r['drafting']:>8} {r['concurrency']:>5} {r['requests']:>5} {r['req_per_s']:>7} {r['out_tok_per_s']:>10} "
        f"{r['ttft_ms']:>8} {r['tpot_ms']:>8} {r['tau']:>5}" for r in rows
    ]
    return "\n".join(lines)
