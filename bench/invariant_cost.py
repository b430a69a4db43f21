"""What ``model.batch_invariant`` costs: the 8B-shaped random pair's `none` step and DFlash round
(τ = 1, random weights) at batch 1, with the flag off and on, alternating in one process so
that drift between runs shows up as spread, not as cost.

`python bench/invariant_cost.py [--spec specs/qwen3-8b-random-dflash.yaml] [--settings off,on,off,on]
[--batch-sizes 1]` (CUDA machine). Prints the rows of `draftline bench` for each setting, then
each setting's median ms per round and its ratio to the bandwidth floor."""

from __future__ import annotations

import argparse
import statistics

import torch

from draftline.core import benchmark
from draftline.core.engine import Engine
from draftline.core.spec import load_spec


def _spec(path: str, invariant: bool, max_batch: int):
    data = load_spec(path).model_dump(mode="python")
    data["model"]["batch_invariant"] = invariant
    data["server"]["max_batch_size"] = max_batch
    return type(load_spec(path)).model_validate(data)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="specs/qwen3-8b-random-dflash.yaml")
    ap.add_argument("--settings", default="off,on,off,on")
    ap.add_argument("--batch-sizes", default="1")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    bandwidth, runs = None, []
    for setting in args.settings.split(","):
        engine = Engine(_spec(args.spec, setting == "on", max(batches)), draft_policy="always")
        bandwidth = bandwidth or benchmark.copy_bandwidth(engine.device)
        for run in (engine.with_method({"method": "none"}), engine):
            rows = benchmark.bench_method(run, batches, args.prompt_len, args.new_tokens, bandwidth)
            runs += [(setting, r) for r in rows]
            print(f"batch_invariant {setting}\n{benchmark.format_rows(rows, bandwidth)}", flush=True)
            del run
        del engine
        torch.cuda.empty_cache()
    print(f"{'method':<11}{'batch':>6}{'invariant':>10}{'ms/round (median)':>19}{'x floor':>9}{'runs':>6}")
    for method in dict.fromkeys(r.method for _, r in runs):
        for b in batches:
            for setting in dict.fromkeys(s for s, _ in runs):
                mine = [r for s, r in runs if s == setting and r.method == method and r.batch == b]
                ms = statistics.median(r.ms_round for r in mine)
                print(f"{method:<11}{b:>6}{setting:>10}{ms:>19.3f}{ms / mine[0].floor_ms:>9.2f}{len(mine):>6}")


if __name__ == "__main__":
    main()
