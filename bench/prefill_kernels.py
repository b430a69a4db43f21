"""Where a prefill's device time goes (CUDA machine): N fresh prompts of L tokens prefilled
together, one new token each (so nothing but the prefill runs), after a warm pass of the same
shape; torch.profiler over the second pass, kernels summed by name. Prints, for each N: ms of
wall and µs of kernels a prefill, µs of kernels a prompt token, and the kernels with the most
device time. A prefill's µs a token counts all its kernels (attention, the drafter's prompt
entries, the head, the prefix store's copies): set beside a round's µs of matrix products a
verified token, the gap bounds from above what running prompts inside the round's forward could
save, and the kernels by name say where that gap is.

`python bench/prefill_kernels.py [SPEC] [N,...] [--len=L]` (defaults:
specs/qwen3-8b-random-dflash.yaml 1,8 --len=128). Run it with DRAFTLINE_PDL=0 (a kernel launched
early waits for the one before it inside its own measured time). Without a GPU it runs the cuda
backend in the Triton interpreter (float32, the tiny spec by default), which checks only that the
script runs: the profile there is host time."""

from __future__ import annotations

import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from draftline.core.engine import Engine  # noqa: E402
from draftline.core.sampling import SamplingParams  # noqa: E402
from draftline.core.spec import load_spec  # noqa: E402

TOP = 16


def prefill_pass(engine: Engine, n: int, length: int, gen: torch.Generator, gpu: bool) -> None:
    """One warm pass and one profiled pass of ``n`` prompts, each pass's prompts drawn afresh
    from ``gen`` (one generator a run: no pass meets another's blocks in the prefix cache)."""
    vocab = engine.target.config.vocab_size
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    engine.generate(torch.randint(10, vocab, (n, length), generator=gen).tolist(), params)  # warm: this shape
    prompts = torch.randint(10, vocab, (n, length), generator=gen).tolist()
    activities = [ProfilerActivity.CUDA] if gpu else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        engine.generate(prompts, params)
        if gpu:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = [e for e in prof.key_averages() if (e.self_device_time_total if gpu else e.self_cpu_time_total) > 0]
    cost = (lambda e: e.self_device_time_total) if gpu else (lambda e: e.self_cpu_time_total)
    total = sum(map(cost, events))
    print(f"\n{n} prompts x {length} tokens: {1e3 * wall:.2f} ms wall, {total / 1e3:.2f} ms "
          f"{'of kernels' if gpu else 'of host ops'}, {total / (n * length):.1f} us a prompt token")
    for e in sorted(events, key=cost, reverse=True)[:TOP]:
        print(f"  {cost(e):10.1f} us {e.count:6d} calls  {e.key[:100]}")


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    length = next((int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--len=")), 128)
    gpu = torch.cuda.is_available()
    path = args[0] if args else ("specs/qwen3-8b-random-dflash.yaml" if gpu else "specs/tiny-dflash.yaml")
    sizes = [int(x) for x in (args[1] if len(args) > 1 else "1,8").split(",")]
    spec = load_spec(path)
    data = spec.model_dump(mode="python")
    data["backend"] = "cuda"
    data["server"]["max_batch_size"] = max(data["server"]["max_batch_size"], max(sizes))
    if not gpu:  # the interpreter: float32, a short cache
        data["model"].update(device="cpu", dtype="float32", max_model_len=max(2 * length, 64))
    engine, gen = Engine(type(spec).model_validate(data)), torch.Generator().manual_seed(0)
    for n in sizes:
        prefill_pass(engine, n, length, gen, gpu)


if __name__ == "__main__":
    main()
