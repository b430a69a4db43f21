"""Prefills beside the rounds against prefills in line (backends/cuda/beside.py), on the same host
at the same moments: one process builds each method's engine both ways (and `none`), then runs
their passes in turn, ``--repeats`` times, so a host that speeds up or slows down mid-run moves
all three alike. Each pass is `Engine.generate` over ``--prompts`` prompts through ``--slots``
slots (a finished request's slot takes the next prompt), greedy, 128 new tokens, drafting
forced on, the shipped trained pair on the GPU.

`python bench/prefill_beside.py [--methods dflash,eagle3,gemma4_mtp] [--slots 16] [--prompts 48]
[--repeats 7]` (CUDA machine). Prints per method the median pass (ms) for each arm, the
speedup over `none` of the median passes, and the rounds a pass, rows a round and prefills."""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from draftline.core.engine import Engine
from draftline.core.sampling import SamplingParams
from draftline.core.spec import load_spec
from draftline.core.training.corpus import read_prompts

SPECS = {"dflash": "specs/tiny-dflash.yaml", "eagle3": "specs/tiny-eagle3.yaml", "gemma4_mtp": "specs/tiny-gemma4-mtp.yaml"}


def _engine(path: str, slots: int, beside: bool, method: dict | None = None) -> Engine:
    data = load_spec(path).model_dump(mode="python")
    data["backend"], data["model"]["device"] = "cuda", "cuda"
    data["server"].update(max_batch_size=slots, pipeline_depth=2)
    if method is not None:
        data["speculative"] = method
    os.environ["DRAFTLINE_PREFILL_BESIDE"] = "1" if beside else "0"  # read when the backend is built
    try:
        return Engine(type(load_spec(path)).model_validate(data), draft_policy="always")
    finally:
        del os.environ["DRAFTLINE_PREFILL_BESIDE"]


def _pass(engine: Engine, prompts: list[str], params: SamplingParams) -> tuple[float, int, int, int]:
    """(seconds, rounds, row-rounds, prefills) of one generate call over every prompt."""
    clock = engine.machine.clock
    rounds, prefills = clock.rounds, clock.prefills
    torch.cuda.synchronize()
    start = time.perf_counter()
    done = engine.generate(prompts, params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    rows = sum(c.meta_info["spec_verify_ct"] for c in done)
    return seconds, clock.rounds - rounds, rows, clock.prefills - prefills


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="dflash,eagle3,gemma4_mtp")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    prompts = read_prompts("specs/tiny/eval_prompts.jsonl")[: args.prompts]
    params = SamplingParams(max_new_tokens=128, ignore_eos=True)
    print(f"{'method':<11}{'beside ms':>10}{'in line ms':>11}{'none ms':>9}{'beside x':>9}{'in line x':>10}"
          f"{'rounds':>13}{'rows':>12}{'prefills':>10}")
    for name in args.methods.split(","):
        arms = {"beside": _engine(SPECS[name], args.slots, True), "in line": _engine(SPECS[name], args.slots, False)}
        arms["none"] = _engine(SPECS[name], args.slots, False, {"method": "none"})
        for engine in arms.values():
            engine.generate(prompts, params)  # the prompts' first pass (later ones hit the prefix cache alike)
        runs = {k: [] for k in arms}
        for _ in range(args.repeats):
            for k, engine in arms.items():
                runs[k].append(_pass(engine, prompts, params))
        ms = {k: 1e3 * statistics.median(r[0] for r in v) for k, v in runs.items()}
        shape = {k: (v[0][1], v[0][2] / max(1, v[0][1]), v[0][3]) for k, v in runs.items()}
        b, i = shape["beside"], shape["in line"]
        print(f"{name:<11}{ms['beside']:>10.2f}{ms['in line']:>11.2f}{ms['none']:>9.2f}"
              f"{ms['none'] / ms['beside']:>8.2f}x{ms['none'] / ms['in line']:>9.2f}x"
              f"{b[0]:>6} / {i[0]:<5}{b[1]:>5.1f} / {i[1]:<5.1f}{b[2]:>4} / {i[2]:<4}", flush=True)
        del arms
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
