"""Where the host's time goes: cProfile over `Engine.generate` with the shipped trained pair on
the cuda backend (CUDA machine), and the prefill's share.
`python bench/host_profile.py [SPEC] [BATCH] [DEPTH] [continuous]`: static feeds generate
calls of BATCH prompts; continuous one call of 4 x BATCH prompts over BATCH slots."""
import cProfile
import pstats
import sys
import time

import torch

from draftline.core.engine import Engine
from draftline.core.sampling import SamplingParams
from draftline.core.spec import load_spec
from draftline.core.training.corpus import read_prompts


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "specs/tiny-dflash.yaml"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    depth = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    data = load_spec(path).model_dump(mode="python")
    data["backend"], data["model"]["device"] = "cuda", "cuda"
    data["server"].update(max_batch_size=max(batch, 2), pipeline_depth=depth)
    engine = Engine(type(load_spec(path)).model_validate(data), draft_policy="always")
    prompts = read_prompts("specs/tiny/eval_prompts.jsonl")[: 4 * batch]
    params = SamplingParams(max_new_tokens=128, ignore_eos=True)
    engine.generate(prompts[:batch], params)
    torch.cuda.synchronize()
    prof, clock = cProfile.Profile(), engine.machine.clock
    rounds, start = clock.rounds, time.perf_counter()
    prof.enable()
    per_call = len(prompts) if "continuous" in sys.argv[4:] else batch
    for i in range(0, len(prompts), per_call):
        engine.generate(prompts[i : i + per_call], params)
    prof.disable()
    torch.cuda.synchronize()
    seconds, rounds = time.perf_counter() - start, clock.rounds - rounds
    print(f"{path} batch {batch} depth {depth} {'continuous' if per_call > batch else 'static'}: {1e3 * seconds / rounds:.3f} ms per round under the profiler "
          f"({rounds} rounds); host work {clock.host_us_per_round:.0f} us/round")
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    pstats.Stats(prof).sort_stats("cumtime").print_stats(18)


if __name__ == "__main__":
    main()
