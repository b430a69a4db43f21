"""Where the GPU's time goes in `Engine.generate` with the shipped trained pair (CUDA machine):
torch.profiler over one warm pass, kernels summed by name, against the pass's wall time.

`python bench/gpu_profile.py [SPEC] [BATCH] [DEPTH] [--none] [--plain] [--prompts=N] [--tokens=T] [--top=K]`:
prints wall ms, rounds, host work per round, GPU kernel ms in all (their sum: what a fully busy
GPU would take) and the kernels with the most GPU time (K of them, 18 unless given). --none runs
the spec's target with method `none`; --plain turns the batch-invariant kernels off
(`model.batch_invariant: false`); --prompts=N feeds N prompts through BATCH slots (a continuous
feed, prefills among the rounds) instead of one static batch; --tokens=T new tokens a request
(128). Without a GPU the cuda backend runs in Triton's interpreter and the profile is of host
ops, which checks only that the tool runs."""
import sys
import time

from torch.profiler import ProfilerActivity, profile

from draftline.core.benchmark import cuda_spec, interpret_without_gpu, synchronize
from draftline.core.engine import Engine
from draftline.core.sampling import SamplingParams
from draftline.core.training.corpus import read_prompts


def _flag(name: str, default: int) -> int:
    return next((int(a.split("=")[1]) for a in sys.argv if a.startswith(f"--{name}=")), default)


def main():
    cpu = interpret_without_gpu()
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    path = args[0] if args else "specs/tiny-dflash.yaml"
    batch = int(args[1]) if len(args) > 1 else 1
    depth = int(args[2]) if len(args) > 2 else 2
    spec = cuda_spec(path, max(batch, 2), depth, **({"batch_invariant": False} if "--plain" in sys.argv else {}))
    if "--none" in sys.argv:
        spec = spec.with_method({"method": "none"})
    engine = Engine(spec, draft_policy="always")
    feed = _flag("prompts", batch)
    prompts = read_prompts("specs/tiny/eval_prompts.jsonl")[: 2 * feed]
    params = SamplingParams(max_new_tokens=_flag("tokens", 128), ignore_eos=True)
    engine.generate(prompts[:feed], params)
    synchronize()
    clock = engine.machine.clock
    rounds, step, wait, prefills = clock.rounds, clock.step_s, clock.wait_s, clock.prefills
    with profile(activities=[ProfilerActivity.CPU] if cpu else [ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        out = engine.generate(prompts[feed : 2 * feed], params)
        synchronize()
        wall = time.perf_counter() - start
    rounds = clock.rounds - rounds
    tokens = sum(len(c.output_ids) for c in out)
    host = 1e6 * ((clock.step_s - step) - (clock.wait_s - wait)) / max(1, rounds)
    cost = (lambda e: e.self_cpu_time_total) if cpu else (lambda e: e.self_device_time_total)
    events = [e for e in prof.key_averages() if cost(e) > 0]
    gpu_us = sum(map(cost, events))
    name = "none" if "--none" in sys.argv else engine.plan.method
    kernels = "plain" if "--plain" in sys.argv else "default"
    print(f"{path} ({name}, {kernels} kernels) batch {batch} depth {depth}: wall {1e3 * wall:.1f} ms, {rounds} rounds, "
          f"{tokens} tokens, {clock.prefills - prefills} prefills, {1e3 * wall / max(1, rounds):.3f} ms/round wall, kernels {gpu_us / 1e3:.1f} ms "
          f"({gpu_us / max(1, rounds):.0f} us/round), host work {host:.0f} us/round")
    events.sort(key=lambda e: -cost(e))
    for e in events[: _flag("top", 18)]:
        print(f"  {cost(e) / max(1, rounds):8.1f} us/round {e.count / max(1, rounds):6.1f}/round  "
              f"{e.key[:90]}")


if __name__ == "__main__":
    main()
