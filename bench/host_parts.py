"""Where the engine's host time goes at a batch size, part by part, timed with perf_counter
(no profiler: cProfile doubles the cost of small calls and hides where a C call waits).

`python bench/host_parts.py [--methods dflash,none] [--batch 16] [--prompts 48] [--tokens 128]
[--json-schema FILE]`
(CUDA machine; without one the cuda backend runs in Triton's interpreter, which checks only that
the tool runs): the shipped trained pair, `backend: cuda`, depth 2, greedy, drafting forced on,
one `generate` call over BATCH slots (the continuous feed), a warm-up pass first. Each part's
time is inclusive (a part inside another is counted in both) and reported in µs per round, with
its calls per round; "wall" is the pass's wall time a round, "wait" the machine's blocked collects.
--json-schema FILE: every request held to that schema (structured outputs), with the grammar's
host parts (each request's matcher, the masks' fill, the constrained rounds) timed too."""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable

from draftline.core.benchmark import SHIPPED, cuda_spec, interpret_without_gpu, synchronize
from draftline.core.engine import Engine
from draftline.core.grammar import Constraint
from draftline.core.sampling import SamplingParams
from draftline.core.training.corpus import read_prompts

PARTS = {  # owner (an attribute path from the engine) -> methods timed on it
    "machine": ("step", "_prefill", "_launch", "_collect", "_book", "_preempt"),
    "scheduler": ("schedule", "reap"),
    "policy": ("choose", "record"),
    "backend": ("prefill", "launch", "collect", "_replay", "free"),
    "backend.prefiller": ("_admit", "_prefill_groups", "_prefill_group", "_load_prefill", "_first_tokens"),
    "backend.landing": ("land", "started"),
    "backend.bufs": ("load",),
    "backend.graphs": ("run",),
    "backend.prefiller.graphs": ("run",),
    "backend.prefiller.prefix_store": ("restore", "stages", "saves", "copy", "release"),
    "backend.cache": ("flush", "allocate", "reserve", "release"),
    "backend.staging": ("put", "put_many", "put_into"),  # the backend's own calls (the prefix store bound its own at start-up)
    "backend.constrained": ("launch", "_unmasked", "_host_drafts", "_put_drafts", "_reverified"),
    "backend.constrained.masks": ("load",),
}
MATCHER = ("fill_window", "choose", "advance")  # timed on each constrained request's matcher


def _owner(engine: Engine, path: str):
    obj = engine
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def instrument(engine: Engine) -> dict[str, list[float]]:
    """Wrap each part on its instance -> {part: [seconds, calls]}, filled as the engine runs."""
    spent: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for path, names in PARTS.items():
        owner = _owner(engine, path)
        for name in names if owner is not None else ():
            if hasattr(owner, name):
                setattr(owner, name, _timed(getattr(owner, name), spent[f"{path}.{name}"]))
    return spent


def instrument_grammars(engine: Engine, spent: dict[str, list[float]]) -> None:
    """Time every request's matcher, each made as its request is added (a plain round's masks
    are filled in one loop over the matchers: backend.constrained.masks.load times it)."""
    grammars = engine.grammars
    made = grammars.matcher

    def matcher(*args, **kwargs):
        m = made(*args, **kwargs)
        for name in MATCHER:
            setattr(m, name, _timed(getattr(m, name), spent[f"matcher.{name}"]))
        return m
    grammars.matcher = matcher


def _timed(fn: Callable, cell: list[float]) -> Callable:
    def run(*args, **kwargs):
        begin = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            cell[0] += time.perf_counter() - begin
            cell[1] += 1
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="dflash,none")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=128, help="new tokens a request")
    ap.add_argument("--json-schema", help="hold every output to this JSON schema file (structured outputs)")
    args = ap.parse_args()
    interpret_without_gpu()
    prompts = read_prompts("specs/tiny/eval_prompts.jsonl")
    schema = None if args.json_schema is None else Constraint("json_schema", open(args.json_schema).read())
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=schema is None, constraint=schema)
    engines: dict[str, Engine] = {}
    for method in args.methods.split(","):
        if method == "none":
            first = next(iter(engines.values()), None) or Engine(cuda_spec(SHIPPED["dflash"], args.batch, 2))
            engine = first.with_method({"method": "none"})
        else:
            engine = Engine(cuda_spec(SHIPPED[method], args.batch, 2), draft_policy="always")
        engines[method] = engine
        engine.generate(prompts[: args.prompts], params)  # warm-up: the same shapes, other prompts below
        spent, clock = instrument(engine), engine.machine.clock
        if schema is not None:
            instrument_grammars(engine, spent)
        rounds0, prefills0, wait0 = clock.rounds, clock.prefills, clock.wait_s
        synchronize()
        begin = time.perf_counter()
        engine.generate(prompts[args.prompts : 2 * args.prompts], params)
        synchronize()
        wall = time.perf_counter() - begin
        rounds, prefills = clock.rounds - rounds0, clock.prefills - prefills0
        print(f"\n{method} batch {args.batch}: {rounds} rounds, {prefills} prefill launches, wall "
              f"{1e6 * wall / rounds:.0f} us a round, blocked in collect {1e6 * (clock.wait_s - wait0) / rounds:.0f}")
        print(f"{'part':<40} {'us/round':>9} {'calls/round':>12} {'us/call':>8}")
        for part, (seconds, calls) in sorted(spent.items(), key=lambda kv: -kv[1][0]):
            if calls:
                print(f"{part:<40} {1e6 * seconds / rounds:9.1f} {calls / rounds:12.2f} {1e6 * seconds / calls:8.1f}")


if __name__ == "__main__":
    main()
