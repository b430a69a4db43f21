"""Where a drafting round's device time goes on the 8B shape under SIMULATED acceptance (CUDA
machine): torch.profiler over the rounds of one static batch, kernels summed by name per round,
beside a `none` step's kernels at the same batch.

`python bench/round_kernels.py [SPEC] [BATCH] [WIDTH] [PROFILE] [--merge-most=N]` (defaults:
specs/qwen3-8b-random-dflash.yaml 64 8 dflash-paper). Prints, for `none` and the method: ms a
round (wall), kernel µs a round in all, and the kernels with the most device time a round.
Run it with DRAFTLINE_PDL=0: a kernel launched early waits for the one before it inside its
own measured time. --merge-most sets the invariant attention plan's INVARIANT_MERGE_MOST (splits
up to which the last program to finish merges them, past which a combine kernel runs) for this run."""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from draftline.backends.cuda import attention
from draftline.core import benchmark
from draftline.core.engine import Engine
from draftline.core.sampling import SamplingParams
from draftline.core.simulated import profile_rate
from draftline.core.spec import load_spec

PROMPT, TOKENS = 128, 128


def profiled(engine: Engine, prompts: list[list[int]], label: str) -> None:
    """One warm pass, then the rounds of a second under the profiler, kernels per round."""
    params = SamplingParams(max_new_tokens=TOKENS, ignore_eos=True)
    benchmark._decode(engine, prompts, 32)
    reqs = [engine.add_request(p, params) for p in prompts]
    engine.step()  # the prefill and the first rounds, outside the profile
    torch.cuda.synchronize()
    rounds0, out0 = engine.machine.clock.rounds, sum(len(r.output_ids) for r in reqs)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        while engine.scheduler.has_work():
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    rounds = engine.machine.clock.rounds - rounds0
    tokens = sum(len(r.output_ids) for r in reqs) - out0
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    print(f"\n{label}: {rounds} rounds, {tokens / max(1, rounds * len(prompts)):.2f} tokens a row-round, "
          f"{1e3 * wall / max(1, rounds):.3f} ms a round wall, kernels {total / max(1, rounds):.0f} us a round, "
          f"{tokens / wall:.0f} tok/s")
    events.sort(key=lambda e: -e.self_device_time_total)
    for e in events[:24]:
        print(f"  {e.self_device_time_total / max(1, rounds):9.1f} us {e.count / max(1, rounds):6.1f}/round  "
              f"{e.key[:100]}")


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    for a in sys.argv[1:]:
        if a.startswith("--merge-most="):
            attention.INVARIANT_MERGE_MOST = int(a.split("=")[1])
    path = args[0] if args else "specs/qwen3-8b-random-dflash.yaml"
    batch = int(args[1]) if len(args) > 1 else 64
    width = int(args[2]) if len(args) > 2 else 8
    rate = profile_rate(args[3] if len(args) > 3 else "dflash-paper")
    spec = load_spec(path)
    server = {"max_batch_size": max(batch, spec.server.max_batch_size), "enable_prefix_caching": False,
              "max_num_batched_tokens": max(spec.server.max_num_batched_tokens, batch * PROMPT)}
    spec = spec.model_copy(update={"server": spec.server.model_copy(update=server)})
    engine = Engine.from_spec(spec, draft_policy="always")
    none = engine.with_method({"method": "none"})
    prompts = benchmark.random_prompts(none.target.config.vocab_size, batch, PROMPT, seed=batch)
    continuations = benchmark.greedy_continuations(none, prompts, TOKENS + 64)
    profiled(none, prompts, f"none, batch {batch}")
    del none
    torch.cuda.empty_cache()
    sim = benchmark.simulate(engine, continuations)
    passes, moved = benchmark.settle(engine, sim, prompts, TOKENS + 64, rate)
    engine.policy.width = width
    profiled(engine, prompts, f"{engine.plan.method} width {width}, batch {batch}, SIMULATED rate {rate} "
             f"({passes} passes, {len(moved)} rows moving)")


if __name__ == "__main__":
    main()
