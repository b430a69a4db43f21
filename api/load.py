"""bench-serve's clients: concurrent streaming requests to /generate, timed as a user sees
them (time to first token, time per output token, gaps between streamed chunks). Imports
nothing heavy: it runs in a process of its own, beside the server's."""

from __future__ import annotations

import asyncio
import json
import time
from statistics import mean, median

import httpx


def measure(url: str, prompts: list, concurrency: int, count: int, max_new: int, speculative: bool,
            long_prompt: list[int] | None = None) -> dict:
    """level() to its end (a process pool's entry point)."""
    return asyncio.run(level(url, prompts, concurrency, count, max_new, speculative, long_prompt))


async def deliveries(resp: httpx.Response):
    """(the time of a network read, the SSE data lines it completed), read by read: the events
    one read brings arrive together, however far apart the server sent them."""
    pending = ""
    async for piece in resp.aiter_text():
        now = time.perf_counter()
        *lines, pending = (pending + piece).split("\n")
        yield now, [line for line in lines if line.startswith("data: {")]


async def one(client: httpx.AsyncClient, prompt: str | list[int], max_new: int, speculative: bool) -> dict:
    """One streamed request. An arrival is a read that brought new tokens: events read together
    count once (``merged`` counts the events beyond the first), so a client that falls behind
    the stream is not mistaken for a server whose steps came microseconds apart."""
    body = {"stream": True, "speculative": speculative, "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}}
    body |= {"text": prompt} if isinstance(prompt, str) else {"input_ids": prompt}
    start, arrivals, last, events, merged = time.perf_counter(), [], None, 0, 0
    async with client.stream("POST", "/generate", json=body) as resp:
        resp.raise_for_status()
        async for now, lines in deliveries(resp):
            fresh = 0
            for line in lines:
                chunk = json.loads(line[6:])
                fresh += len(chunk["output_ids"]) > len((last or {}).get("output_ids", []))
                last = chunk
            if fresh:
                arrivals.append(now)
                events, merged = events + fresh, merged + fresh - 1
    end = time.perf_counter()
    reason = (last or {}).get("meta_info", {}).get("finish_reason") or {}
    if not arrivals or reason.get("type") == "abort":  # a benchmark of failed requests measures nothing
        raise RuntimeError(f"bench-serve: a request failed ({reason.get('message', 'no tokens streamed')}); "
                           "the server's log names the cause")
    n = last["meta_info"]["completion_tokens"]
    return {"start": start, "arrivals": arrivals, "ttft": arrivals[0] - start,
            "tpot": (end - arrivals[0]) / max(1, n - 1), "tokens": n, "events": events, "merged": merged,
            "gaps": [b - a for a, b in zip(arrivals, arrivals[1:])], "tau": last["meta_info"]["spec_accept_length"],
            "prompt": last["meta_info"]["prompt_tokens"], "cached": last["meta_info"]["cached_tokens"],
            "preemptions": last["meta_info"].get("preemptions", 0)}


def _client(url: str) -> httpx.AsyncClient:
    """A stream's own client and connection, kept alive from one request to the next. One client
    shared by every stream capped them at its pool's 100 connections (the rest queued in the
    client, counted as their TTFT), and with a connection per stream in one pool, its bookkeeping
    (each request's assignment scans every connection) bound the clients' process at 128 streams."""
    return httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=1))


async def level(url: str, prompts: list, concurrency: int, count: int, max_new: int, speculative: bool,
                 long_prompt: list[int] | None = None) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(count):
        queue.put_nowait(prompts[i % len(prompts)])
    results: list[dict] = []
    long: list[dict] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            results.append(await one(client, queue.get_nowait(), max_new, speculative))

    async def send_long(client: httpx.AsyncClient) -> None:  # once half the requests are done
        while len(results) < count // 2:
            await asyncio.sleep(0.005)
        long.append(await one(client, long_prompt, 1, speculative))

    clients = [_client(url) for _ in range(concurrency + bool(long_prompt))]  # before the clock: each costs ms
    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in clients[:concurrency]),
                             *([send_long(clients[-1])] if long_prompt else []))
        wall = time.perf_counter() - t0
    finally:
        for c in clients:
            await c.aclose()
    gaps = [g for r in results for g in r["gaps"]]
    worst = worst_gap(results)
    return {"concurrency": concurrency, "requests": count, "req_per_s": round(count / wall, 2),
            "out_tok_per_s": round(sum(r["tokens"] for r in results) / wall, 1),
            "ttft_ms": round(1e3 * mean(r["ttft"] for r in results), 1),
            "ttft_p50_ms": round(1e3 * median(r["ttft"] for r in results), 1),
            "tpot_ms": round(1e3 * mean(r["tpot"] for r in results), 2),
            "itl_p50_ms": round(1e3 * median(gaps), 2) if gaps else 0.0,
            "gap_ratio": round((worst[1] - worst[0]) / worst[2], 2) if worst else 0.0,  # worst request: its longest gap / its median
            "merged_share": round(sum(r["merged"] for r in results) / max(1, sum(r["events"] for r in results)), 3),
            "long_ttft_ms": round(1e3 * long[0]["ttft"], 1) if long else None,
            "long_gap_ratio": round(prefill_gaps(results, long[0]), 2) if long else None,
            "worst_gap": worst,
            "tau": round(mean(r["tau"] for r in results), 2),
            "cached_share": round(sum(r["cached"] for r in results) / max(1, sum(r["prompt"] for r in results)), 3),
            "preemptions": sum(r["preemptions"] for r in results)}


def worst_gap(results: list[dict]) -> list[float] | None:
    """The worst request's longest gap as [its start, its end, that request's median gap] in
    seconds of perf_counter, the clock the server's round trace keeps (one monotonic clock for
    every process of the host), so the trace can say what the engine did meanwhile."""
    streams = [r for r in results if len(r["gaps"]) >= 3 and median(r["gaps"]) > 0]
    if not streams:
        return None
    worst = max(streams, key=lambda r: max(r["gaps"]) / median(r["gaps"]))
    i = max(range(len(worst["gaps"])), key=worst["gaps"].__getitem__)
    return [worst["arrivals"][i], worst["arrivals"][i + 1], median(worst["gaps"])]


def prefill_gaps(results: list[dict], long: dict) -> float:
    """The worst gap, over its own request's median gap, of the requests streaming while the
    long prompt was prefilled (from its send to its first token): the gaps that window touches."""
    w0, w1 = long["start"], long["arrivals"][0]
    ratios = [(b - a) / median(r["gaps"]) for r in results if len(r["gaps"]) >= 3 and median(r["gaps"]) > 0
              for a, b in zip(r["arrivals"], r["arrivals"][1:]) if b > w0 and a < w1]
    return max(ratios, default=0.0)
