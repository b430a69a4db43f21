"""Where the host's time goes in a decode round: cProfile over steady-state engine steps
(CUDA machine). `python bench/host_profile.py SPEC [BATCH]`."""
import cProfile
import pstats
import sys
import time

import torch

from core.benchmark import _prompts
from core.engine import Engine
from core.sampling import SamplingParams


def main():
    spec, batch = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1
    engine = Engine.from_spec(spec, draft_policy="always")
    for _ in range(2):
        for p in _prompts(engine, batch, 512, 0):
            engine.add_request(p, SamplingParams(max_new_tokens=96, ignore_eos=True))
        engine.step()
        for _ in range(16):
            engine.step()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        start, steps = time.perf_counter(), 0
        prof.enable()
        while engine.scheduler.has_work():
            engine.step()
            steps += 1
        prof.disable()
        torch.cuda.synchronize()
    print(f"{steps} steps, {1e3 * (time.perf_counter() - start) / steps:.3f} ms per step under the profiler")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
