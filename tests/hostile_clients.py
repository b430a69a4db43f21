"""Measures the serving hardening targets against a real `draftline serve` process (the default
spec, tiny DFlash) and the real CLI, and prints each number:

  python tests/hostile_clients.py [--examples 50] [--skip-cli]

1. fuzz: schemathesis over every route (valid and invalid bodies) plus a hand list of bad
   values (NaN, Infinity, wrong types, oversized): responses >= 500, tracebacks in the
   server's log, /health after each, a greedy baseline before and after;
2. stall: a third client's 32-token greedy request alone, then while one client sends a 50 MB
   body and another a 200,000-character stop string (each from a process of its own, anew for
   every timed request): with the default limits (both refused before any work) and with the
   limits raised so that the stop string runs a 400-token request, there also against the same
   request with a short stop string (what any second running request costs the third); and
   /health's worst latency while a 5 MB prompt is tokenized and while 8 MiB of token ids parse;
3. slots: 8 non-streaming clients that time out after 1 s: seconds from their disconnects
   until every slot is free;
4. cli: the 22 broken invocations of tests/broken_inputs.py, each as a process: exit code,
   lines on stderr, tracebacks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
THIRD = {"text": "def add(a, b):", "sampling_params": {"max_new_tokens": 32, "ignore_eos": True}}


class Server:
    """`python -m draftline serve` on a free port with a spec's server section overridden."""

    def __init__(self, folder: Path, **server):
        from draftline.api.server import free_port

        self.port = free_port()
        spec = (HERE.parent / "specs" / "tiny-dflash.yaml").read_text()
        spec = spec.replace("path: tiny/", f"path: {HERE.parent / 'specs' / 'tiny'}/")
        fields = {"port": self.port, "max_batch_size": 8, **server}
        path = folder / f"spec-{self.port}.yaml"
        path.write_text(spec.split("\nserver:")[0] + "\nserver: " + json.dumps(fields) + "\n")
        self.log = open(folder / f"server-{self.port}.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "draftline", "serve", "--spec", str(path)],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        for _ in range(600):
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError("the server did not start: " + self.text()[-2000:])

    def text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def _send(url: str, method: str, path: str, **kw) -> int:
    return httpx.request(method, url + path, timeout=120, **kw).status_code


def hand_list() -> list[tuple[str, str]]:
    """(path, raw JSON body) for the bad values a fuzzer built on valid JSON never sends."""
    bodies = []
    routes = {"/generate": lambda f: {"text": "x", "sampling_params": f},
              "/v1/completions": lambda f: {"prompt": "x", **f},
              "/v1/chat/completions": lambda f: {"messages": [{"role": "user", "content": "x"}], **f}}
    for path, make in routes.items():
        for field in ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "repetition_penalty",
                      "seed", "n"):
            for value in (math.nan, math.inf, -math.inf, "5", True, 10**30, -10**30, [1], {"a": 1}):
                bodies.append((path, json.dumps(make({field: value}))))
        bodies += [(path, json.dumps(make({"stream": "yes"}))), (path, json.dumps(make({"stop": ["s" * 300_000]}))),
                   (path, json.dumps(make({"logit_bias": {str(i): 1 for i in range(5000)}}))),
                   (path, json.dumps(make({"logit_bias": {"5": math.nan}}))), (path, "{nope"), (path, "[]"),
                   (path, json.dumps(make({"x" * 100_000: 1})))]
    bodies += [("/v1/completions", json.dumps({"prompt": "x" * 3_000_000})),
               ("/v1/completions", json.dumps({"prompt": [[1, 2]] * 2000})),
               ("/v1/completions", json.dumps({"prompt": "x", "model": "gpt-4o"})),
               ("/generate", json.dumps({"input_ids": [10**12]}))]
    return bodies + structured_list()


def structured_list() -> list[tuple[str, str]]:
    """Constraints and tools built to hurt a grammar compiler: deep nesting, a recursive $ref,
    a backtracking regex, a left-recursive grammar, huge enums and choices, many tools."""
    deep: dict = {"type": "string"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8}
    schemas = [deep, {"$ref": "#/$defs/n", "$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}},
               {"enum": [f"v{i}" for i in range(20_000)]}, {"type": "string", "pattern": "(a+)+$"},
               {"type": "object", "properties": {"x": {"type": "nonsense"}}}, {"$ref": "#/missing"}]
    bodies = [("/v1/chat/completions", json.dumps(chat | {"response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})) for schema in schemas]
    bodies += [("/v1/chat/completions", json.dumps(chat | {"guided_regex": "(a|aa)*(b|bb)*" * 50})),
               ("/v1/chat/completions", json.dumps(chat | {"guided_grammar": "root ::= root \"a\" | \"b\""})),
               ("/v1/chat/completions", json.dumps(chat | {"guided_choice": [str(i) for i in range(20_000)]})),
               ("/v1/chat/completions", json.dumps(chat | {"tools": [{"type": "function", "function": {
                   "name": f"f{i}", "parameters": {"type": "object"}}} for i in range(2_000)],
                   "tool_choice": "required"})),
               ("/generate", json.dumps({"text": "x", "sampling_params": {"json_schema": "{not json"}})),
               ("/generate", json.dumps({"text": "x", "sampling_params": {"ebnf": "root ::= (" * 1000}}))]
    return bodies


def fuzz(folder: Path, examples: int) -> dict:
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable

    server = Server(folder)
    greedy = {"text": "def add(a, b):", "sampling_params": {"max_new_tokens": 16, "temperature": 0.0}}
    before = httpx.post(server.url + "/generate", json=greedy, timeout=120).json()["output_ids"]
    counts = {"requests": 0, "5xx": 0, "health_not_200": 0}
    client = httpx.Client(base_url=server.url, timeout=120)

    def record(status: int) -> None:
        counts["requests"] += 1
        counts["5xx"] += status >= 500
        counts["health_not_200"] += client.get("/health").status_code != 200

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    for result in schema.get_all_operations():
        operation = result.ok()
        inputs = operation.method.upper() == "POST" or "{" in operation.path  # what an invalid case can vary
        for mode in schemathesis.GenerationMode if inputs else [schemathesis.GenerationMode.POSITIVE]:
            strategy = operation.as_strategy(generation_mode=mode)  # inputs the schema allows, and others

            @given(strategy)
            @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            def one(case):
                record(case.call(base_url=server.url, timeout=120).status_code)

            try:
                one()
            except Unsatisfiable:  # no invalid form (any string is a valid model id)
                pass
    for path, body in hand_list():
        record(client.post(path, content=body.encode(), headers={"content-type": "application/json"}).status_code)
    after = httpx.post(server.url + "/generate", json=greedy, timeout=120).json()["output_ids"]
    server.stop()
    return counts | {"tracebacks_in_log": server.text().count("Traceback"), "greedy_unchanged": before == after}


async def _third(url: str) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        start = time.perf_counter()
        r = await c.post("/generate", json=THIRD)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 32, r.text[:300]
        return time.perf_counter() - start


_BODIES: dict[str, bytes] = {}


def _attack(url: str, kind: str) -> int:
    """One attacking request, from a process of its own; its status (0: the server closed the
    connection while the body was still being sent). ``kind``: "50MB", a body of 50 MB; "stop",
    a 400-token request with a 200,000-character stop string; "short", the same with "\n\n\n\n"."""
    if kind not in _BODIES:
        stop = {"stop": "x" * 200_000, "short": "\n\n\n\n"}.get(kind)
        body = {"text": "x" * (50 * 2**20)} if kind == "50MB" else \
            {"text": "def f(x):", "sampling_params": {"stop": [stop], "max_new_tokens": 400, "ignore_eos": True}}
        _BODIES[kind] = json.dumps(body).encode()
    try:
        with httpx.Client(base_url=url, timeout=300) as c:
            return c.post("/generate", content=_BODIES[kind], headers={"content-type": "application/json"}).status_code
    except httpx.TransportError:
        return 0


def _under_attack(url: str, runs: int, kinds: tuple[str, ...]) -> tuple[float, dict[str, list[int]]]:
    """The third client's median time while each of ``kinds`` has a request in flight (each
    run sends them anew, from processes of their own), and the attackers' statuses."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    times, seen = [], {k: [] for k in kinds}
    with ProcessPoolExecutor(len(kinds), mp_context=get_context("spawn")) as pool:
        list(pool.map(time.sleep, [0] * len(kinds)))  # the workers started before the clock
        for _ in range(runs):
            attacks = [pool.submit(_attack, url, kind) for kind in kinds]
            time.sleep(0.3)  # the attacks reach the server first
            times.append(asyncio.run(_third(url)))
            for kind, a in zip(kinds, attacks):
                seen[kind].append(a.result())
    return statistics.median(times), seen


def _worst_health_while(url: str, send) -> tuple[float, int]:
    """/health's worst latency while ``send()`` runs in a thread, and send's status."""
    out: list[int] = []
    worker = threading.Thread(target=lambda: out.append(send()))
    worst = 0.0
    with httpx.Client(base_url=url, timeout=120) as c:
        c.get("/health")
        worker.start()
        while worker.is_alive():
            start = time.perf_counter()
            c.get("/health")
            worst = max(worst, time.perf_counter() - start)
            time.sleep(0.01)
    return worst, out[0]


def stall(folder: Path, runs: int) -> dict:
    out = {}
    for name, server_fields in (("default limits", {}),
                                ("stop limit raised", {"max_stop_chars": 200_000, "max_request_bytes": 16 * 2**20})):
        server = Server(folder, **server_fields)
        alone = statistics.median([asyncio.run(_third(server.url)) for _ in range(runs)])
        row = {"alone_s": round(alone, 3)}
        if server_fields:  # the stop string runs: against the same request with a short stop string
            control, seen = _under_attack(server.url, runs, ("50MB", "short"))
            row |= {"with_a_short_stop_request_s": round(control, 3), "statuses_control": seen}
        during, seen = _under_attack(server.url, runs, ("50MB", "stop"))
        row |= {"under_attack_s": round(during, 3), "ratio_to_alone": round(during / alone, 2), "statuses": seen}
        if server_fields:
            row["ratio_to_control"] = round(during / control, 2)
        out[name] = row
        server.stop()
    server = Server(folder, max_prompt_chars=6_000_000, max_request_bytes=9 * 2**20)
    prompt = {"text": "def f(x):\n    return x\n" * (5 * 2**20 // 24), "sampling_params": {"max_new_tokens": 1}}
    worst, status = _worst_health_while(server.url, lambda: _send(server.url, "POST", "/generate", json=prompt))
    out["5 MB prompt (max_prompt_chars raised)"] = {"worst_health_s": round(worst, 3), "status": status}
    ids = {"input_ids": list(range(100_000, 100_000 + 8 * 2**20 // 8))}
    worst, status = _worst_health_while(server.url, lambda: _send(server.url, "POST", "/generate", json=ids))
    out["8 MiB of token ids"] = {"worst_health_s": round(worst, 3), "status": status}
    server.stop()
    return out


async def _impatient(url: str) -> float:
    body = {"text": "def f(x):", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    async with httpx.AsyncClient(base_url=url, timeout=1.0) as c:
        results = await asyncio.gather(*(c.post("/generate", json=body) for _ in range(8)), return_exceptions=True)
    gone = time.perf_counter()
    assert all(isinstance(r, httpx.TimeoutException) for r in results), results
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        while (await c.get("/health")).json()["running"]:
            await asyncio.sleep(0.01)
    return time.perf_counter() - gone


def slots(folder: Path) -> dict:
    server = Server(folder)
    freed = [round(asyncio.run(_impatient(server.url)), 3) for _ in range(3)]
    server.stop()
    return {"seconds_until_every_slot_is_free": freed}


def cli(folder: Path) -> dict:
    import broken_inputs

    rows = []
    for name, argv, needle in broken_inputs.build(folder / "broken"):
        run = subprocess.run([sys.executable, "-m", "draftline", *argv], capture_output=True, text=True, timeout=600,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        lines = [line for line in run.stderr.splitlines() if line.strip() and "[info" not in line]
        rows.append({"invocation": name, "exit": run.returncode, "lines": len(lines),
                     "traceback": "Traceback" in run.stderr, "names_it": needle in run.stderr})
    good = [r for r in rows if r["exit"] == 1 and r["lines"] == 1 and not r["traceback"] and r["names_it"]]
    return {"invocations": len(rows), "exit_1_one_line_no_traceback": len(good),
            "others": [r for r in rows if r not in good]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=50, help="schemathesis examples per route")
    p.add_argument("--runs", type=int, default=5, help="timed requests per condition (the median is shown)")
    p.add_argument("--skip-cli", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        report = {"fuzz": fuzz(folder, args.examples), "stall": stall(folder, args.runs), "slots": slots(folder)}
        if not args.skip_cli:
            report["cli"] = cli(folder)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
