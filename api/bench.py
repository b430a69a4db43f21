"""`draftline bench-serve`: the real server under concurrent streaming load, drafting on and off.

The workload is the shipped eval prompts (text), or random input-id prompts of a chosen length
(``prompt_len``), optionally behind one shared prefix; ``long_prompt`` sends one long prompt
halfway through each level, to show what its prefill does to the running requests' gaps.
``acceptance`` replaces the drafts by each prompt's greedy continuation at a profile's rate
(draftline.core.simulated), for weights whose own drafts are never accepted (the 8B-shaped
random pairs): those numbers are simulated acceptance and are labelled so."""

from __future__ import annotations

import gc
import itertools
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import torch

from draftline.core import benchmark
from draftline.core.engine import Engine
from draftline.core.models.config import ConfigError
from draftline.core.spec import Spec
from draftline.core.training.corpus import read_prompts

from . import load
from .server import background

PROMPTS = Path(__file__).resolve().parent.parent / "specs" / "tiny" / "eval_prompts.jsonl"
WARM_UP = 2  # requests before the first level, alone: the server's first request pays its one-time costs
MODES = {"always": ("always", True), "auto": ("auto", True), "off": ("auto", False)}  # policy, speculative


@dataclass(frozen=True)
class Options:
    levels: list[int]
    requests: int = 0  # per level; 0: max(8, 8 x concurrency)
    max_new: int = 64
    prompt_len: int = 0  # 0: the eval prompts' text; else random input ids of this many tokens
    shared_prefix: int = 0  # tokens of one random prefix before every prompt (with prompt_len)
    long_prompt: int = 0  # tokens of one prompt sent halfway through each level
    acceptance: str = ""  # a draftline.core.simulated profile: simulated acceptance
    modes: tuple[str, ...] = ("always", "auto", "off")
    max_model_len: int = 0  # 0: the spec's
    prefix_caching: bool = True  # False: server.enable_prefix_caching off
    batched_tokens: int = 0  # server.max_num_batched_tokens (0: the spec's)
    kv_blocks: int = 0  # server.num_kv_blocks (0: the spec's)
    memory: float = 0.0  # server.gpu_memory_utilization (0: the spec's)
    admission_wait: int = 0  # server.admission_wait (0: the spec's)
    prefill_stall: float | None = None  # server.max_prefill_stall (None: the spec's; 0: no bound)
    trace: str = ""  # write each mode's collected rounds to TRACE.MODE.jsonl

    def count(self, concurrency: int) -> int:
        return self.requests or max(8, 8 * concurrency)

    def slices(self) -> list[slice]:
        """Input-id prompts: the warm-up's, then each level's own, so that no request repeats
        an earlier one, whose blocks the prefix cache would still hold (a level would then
        measure cache hits; a shared prefix is the one part they have in common)."""
        starts = list(itertools.accumulate([WARM_UP] + [self.count(c) for c in self.levels]))
        return [slice(0, WARM_UP)] + [slice(a, b) for a, b in zip(starts, starts[1:])]


def workload(opts: Options, vocab: int) -> tuple[list[str | list[int]], list[int] | None]:
    """(the prompts, the long prompt or None). Input-id prompts are the warm-up's and each
    level's, in ``opts.slices()``; the eval prompts' text is one pool every level cycles through."""
    if not opts.prompt_len:
        return (read_prompts(PROMPTS) if PROMPTS.is_file() else ["def main():\n"]), None
    prefix = benchmark.random_prompts(vocab, 1, opts.shared_prefix, seed=1)[0] if opts.shared_prefix else []
    count = opts.slices()[-1].stop
    prompts = [prefix + p for p in benchmark.random_prompts(vocab, count, opts.prompt_len, seed=2)]
    return prompts, (benchmark.random_prompts(vocab, 1, opts.long_prompt, seed=3)[0] if opts.long_prompt else None)


def check(opts: Options, spec: Spec) -> None:
    """Workloads the options cannot make, refused before any model loads."""
    if opts.shared_prefix and not opts.prompt_len:
        raise ConfigError("--shared-prefix needs --prompt-len (the unique part of each input-id prompt)")
    if opts.acceptance and not opts.prompt_len:
        raise ConfigError("--acceptance needs --prompt-len: continuations are keyed by input-id prompts")
    if opts.acceptance and spec.speculative.method == "none":
        raise ConfigError("--acceptance needs a spec with a drafting method")
    if opts.trace and not Path(opts.trace).resolve().parent.is_dir():
        raise ConfigError(f"--trace-rounds {opts.trace}: its folder does not exist (the trace is written there "
                          "after the run); create it or name another")
    longest = max(opts.shared_prefix + opts.prompt_len, opts.long_prompt) + opts.max_new
    limit = opts.max_model_len or spec.model.max_model_len
    if longest >= limit:
        raise ConfigError(f"the workload's longest request ({longest} tokens with its new tokens) does not fit "
                          f"max_model_len {limit}; raise --max-model-len or shorten the prompts")


def _continuations(spec: Spec, opts: Options, target: tuple) -> tuple[dict, list, list[int] | None, tuple]:
    """Every prompt's greedy continuation, from a `none` engine over the target, built first and
    gone before the measured engine sizes its KV (a second pool would not fit beside it):
    (continuations, prompts, the long prompt, (target, tokenizer))."""
    none = Engine(spec.with_method({"method": "none"}), *target)
    if none.backend_name != "cuda":
        raise ConfigError("--acceptance runs on the cuda backend (a GPU): set backend: cuda or auto on a GPU machine")
    prompts, long_prompt = workload(opts, none.target.config.vocab_size)
    ids = prompts + ([long_prompt] if long_prompt else [])
    beyond = min(64, spec.model.max_model_len - opts.max_new - max(len(p) for p in ids))  # drafts past the end
    return (benchmark.greedy_continuations(none, ids, opts.max_new + beyond), prompts, long_prompt,
            (none.target, none.tokenizer))


def _release() -> None:
    """What an engine dropped by its last reference held on the device, its graphs and KV,
    given back (the weights stay, shared); the peak counted afresh, so the next engine's
    printed peak is its own."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _simulate(engine: Engine, continuations: dict, prompts: list, opts: Options, rate: float) -> None:
    sim = benchmark.simulate(engine, continuations)
    if not engine.backend.cache.invariant:  # the invariant kernels make `none`'s output the method's own
        benchmark.settle(engine, sim, prompts, opts.max_new, rate)
    sim.set_rate(rate)


def _serve(spec: Spec, engine: Engine, mode: str, opts: Options, prompts: list, long_prompt: list[int] | None
           ) -> list[dict]:
    """One mode's levels against a real server; the clients run in a process of their own, so
    their parsing does not hold this one's interpreter (the server and the engine loop's)."""
    speculative, rows = MODES[mode][1], []
    trace = engine.machine.trace = [] if opts.trace else None
    with background(spec, engine) as url, ProcessPoolExecutor(1, mp_context=get_context("spawn")) as clients:
        own = opts.slices() if opts.prompt_len else [slice(None)] * (1 + len(opts.levels))
        clients.submit(load.measure, url, prompts[own[0]], 1, WARM_UP, 8, speculative).result()
        for c, mine in zip(opts.levels, own[1:]):
            if trace is not None:
                trace.append({"t": time.perf_counter(), "level": c})
            row = clients.submit(load.measure, url, prompts[mine], c, opts.count(c), opts.max_new, speculative,
                                 long_prompt).result()
            gap = row.pop("worst_gap")  # perf_counter times: for the trace, not the table
            if trace is not None and gap is not None:
                trace.append({"t": gap[1], "worst_gap": gap})
            rows.append({"drafting": mode, **row} | ({"policy": _choices(engine)} if mode == "auto" else {}))
            print(f"  {mode} at concurrency {c}: {row['out_tok_per_s']} out tok/s, TTFT p50 {row['ttft_p50_ms']} ms, "
                  f"tau {row['tau']}", file=sys.stderr, flush=True)  # a long run's progress, as it goes
    if trace is not None:
        Path(f"{opts.trace}.{mode}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trace))
    return rows


def _choices(engine: Engine) -> list[str]:
    """What `auto` measured and chose so far, per batch bucket (as /spec shows it): each verify
    width's ms per token and rounds (width 1: plain), and the choice."""
    arms: dict[int, list[dict]] = {}
    for arm in engine.policy.table():
        arms.setdefault(arm["batch_bucket"], []).append(arm)
    out = []
    for size, rows in sorted(arms.items()):
        chosen = next((a["width"] for a in rows if a["chosen"]), None)
        measured = ", ".join(f"width {a['width']} {a['ms_per_token']} ms/token (fastest {a['fastest_ms_per_token']}, "
                             f"{a['rounds']} rounds)" for a in rows)
        verdict = "measuring" if chosen is None else "plain" if chosen == 1 else f"drafts, verifying {chosen}"
        out.append(f"batch {size}: {measured}; {verdict}")
    return out


def run_bench(spec: Spec, opts: Options, as_json: bool) -> str:
    from draftline.core.simulated import profile_rate

    check(opts, spec)
    try:
        rate = profile_rate(opts.acceptance) if opts.acceptance else None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if opts.acceptance and rate is None:
        raise ConfigError("--acceptance random is the drafter's own drafts: leave --acceptance out for that")
    model = spec.model.model_copy(update={"max_model_len": opts.max_model_len}) if opts.max_model_len else spec.model
    server = {"max_batch_size": max(opts.levels)} | ({} if opts.prefix_caching else {"enable_prefix_caching": False})
    server |= {"max_num_batched_tokens": opts.batched_tokens} if opts.batched_tokens else {}
    server |= {"num_kv_blocks": opts.kv_blocks} if opts.kv_blocks else {}
    server |= {"gpu_memory_utilization": opts.memory} if opts.memory else {}
    server |= {"admission_wait": opts.admission_wait} if opts.admission_wait else {}
    server |= {} if opts.prefill_stall is None else {"max_prefill_stall": opts.prefill_stall or None}
    spec = spec.model_copy(update={"model": model, "server": spec.server.model_copy(update=server)})
    rows, target, continuations, prompts, long_prompt = [], (), None, None, None
    for mode in opts.modes:
        if rate is not None and continuations is None:
            continuations, prompts, long_prompt, target = _continuations(spec, opts, target)
            _release()
        engine = Engine(spec, *target, draft_policy=MODES[mode][0])
        target = (engine.target, engine.tokenizer)
        if prompts is None:
            prompts, long_prompt = workload(opts, engine.target.config.vocab_size)
        if rate is not None:
            _simulate(engine, continuations, prompts, opts, rate)
        rows += _serve(spec, engine, mode, opts, prompts, long_prompt)
        _report_pool(engine, mode)
        del engine
        _release()
    return json.dumps(rows) if as_json else _table(rows, opts)


def _report_pool(engine: Engine, mode: str) -> None:
    """The paged pool server.gpu_memory_utilization sized, and the device's peak beside its limit."""
    budget = getattr(engine.backend, "kv_budget", None)
    if budget is not None:
        peak = torch.cuda.max_memory_reserved() / (1 << 30)
        print(f"{mode}: KV pool {budget.summary()}, start-up {engine.startup.get('memory')}, "
              f"peak reserved {peak:.2f} GiB", flush=True)


def _table(rows: list[dict], opts: Options) -> str:
    head = (f"{'drafting':>8} {'conc':>5} {'reqs':>5} {'req/s':>7} {'out tok/s':>10} {'TTFT ms':>8} {'p50':>7} "
            f"{'TPOT ms':>8} {'ITL p50':>8} {'gap x':>6} {'merged':>6} {'tau':>5} {'cached':>6} {'preempt':>7}"
            + (f" {'long TTFT':>9} {'long gap x':>10}" if opts.long_prompt else ""))
    lines = [head] + [
        f"{r['drafting']:>8} {r['concurrency']:>5} {r['requests']:>5} {r['req_per_s']:>7} {r['out_tok_per_s']:>10} "
        f"{r['ttft_ms']:>8} {r['ttft_p50_ms']:>7} {r['tpot_ms']:>8} {r['itl_p50_ms']:>8} {r['gap_ratio']:>6} "
        f"{r['merged_share']:>6} "
        f"{r['tau']:>5} {r['cached_share']:>6} {r['preemptions']:>7}"
        + (f" {r['long_ttft_ms']:>9} {r['long_gap_ratio']:>10}" if opts.long_prompt else "") for r in rows
    ]
    lines += [f"auto after concurrency {r['concurrency']}: " + "; ".join(r["policy"]) for r in rows if r.get("policy")]
    if opts.acceptance:
        lines.insert(0, f"SIMULATED acceptance (--acceptance {opts.acceptance}): drafts replaced by each prompt's "
                        "greedy continuation, wrong at one position a round")
    notes = ["long gap x: the same over the gaps that overlap the long prompt's prefill (its send to its first token)"
             ] if opts.long_prompt else []
    return "\n".join(lines + ["gap x: the worst request's longest gap between the reads that brought it tokens over "
                               "its median gap; merged: the share of streamed chunks read together with an earlier "
                               "one (the clients fell behind); "
                               "cached: the share of prompt tokens the prefix cache gave; preempt: requests' "
                               "preemptions for KV blocks (server.num_kv_blocks)"] + notes)
