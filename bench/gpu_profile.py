"""Where the GPU's time goes in `Engine.generate` with the shipped trained pair (CUDA machine):
torch.profiler over one warm pass, kernels summed by name, against the pass's wall time.

`python bench/gpu_profile.py [SPEC] [BATCH] [DEPTH] [--none] [--plain] [--prompts=N] [--top=K]`: prints wall ms, rounds,
host work per round, GPU kernel ms in all (their sum: what a fully busy GPU would take) and the
kernels with the most GPU time (K of them, 18 unless given). --none runs the spec's target with method `none`; --plain turns
the batch-invariant kernels off (`model.batch_invariant: false`); --prompts=N feeds N prompts
through BATCH slots (a continuous feed, prefills among the rounds) instead of one static batch."""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from draftline.core.engine import Engine
from draftline.core.sampling import SamplingParams
from draftline.core.spec import load_spec
from draftline.core.training.corpus import read_prompts


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    path = args[0] if args else "specs/tiny-dflash.yaml"
    batch = int(args[1]) if len(args) > 1 else 1
    depth = int(args[2]) if len(args) > 2 else 2
    data = load_spec(path).model_dump(mode="python")
    data["backend"], data["model"]["device"] = "cuda", "cuda"
    data["server"].update(max_batch_size=max(batch, 2), pipeline_depth=depth)
    if "--none" in sys.argv:
        data["speculative"] = {"method": "none"}
    if "--plain" in sys.argv:
        data["model"]["batch_invariant"] = False
    engine = Engine(type(load_spec(path)).model_validate(data), draft_policy="always")
    feed = next((int(a.split("=")[1]) for a in sys.argv if a.startswith("--prompts=")), batch)
    prompts = read_prompts("specs/tiny/eval_prompts.jsonl")[: 2 * feed]
    params = SamplingParams(max_new_tokens=128, ignore_eos=True)
    engine.generate(prompts[:feed], params)
    torch.cuda.synchronize()
    clock = engine.machine.clock
    rounds, step, wait, prefills = clock.rounds, clock.step_s, clock.wait_s, clock.prefills
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        out = engine.generate(prompts[feed : 2 * feed], params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    rounds = clock.rounds - rounds
    tokens = sum(len(c.output_ids) for c in out)
    host = 1e6 * ((clock.step_s - step) - (clock.wait_s - wait)) / max(1, rounds)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    gpu_us = sum(e.self_device_time_total for e in events)
    name = "none" if "--none" in sys.argv else engine.plan.method
    kernels = "plain" if "--plain" in sys.argv else "default"
    print(f"{path} ({name}, {kernels} kernels) batch {batch} depth {depth}: wall {1e3 * wall:.1f} ms, {rounds} rounds, "
          f"{tokens} tokens, {clock.prefills - prefills} prefills, {1e3 * wall / max(1, rounds):.3f} ms/round wall, kernels {gpu_us / 1e3:.1f} ms "
          f"({gpu_us / max(1, rounds):.0f} us/round), host work {host:.0f} us/round")
    events.sort(key=lambda e: -e.self_device_time_total)
    top = next((int(a.split("=")[1]) for a in sys.argv if a.startswith("--top=")), 18)
    for e in events[:top]:
        print(f"  {e.self_device_time_total / max(1, rounds):8.1f} us/round {e.count / max(1, rounds):6.1f}/round  "
              f"{e.key[:90]}")


if __name__ == "__main__":
    main()
