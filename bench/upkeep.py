"""What a round that does not draft costs over `none` (the drafter's upkeep), and auto at T=1."""
import time, torch
from draftline.core.benchmark import SHIPPED, cuda_spec, interpret_without_gpu
from draftline.core.engine import Engine
from draftline.core.sampling import SamplingParams
from draftline.core.training.corpus import read_prompts

interpret_without_gpu()
gpu = torch.cuda.is_available()
prompts = read_prompts("specs/tiny/eval_prompts.jsonl")[:8 if gpu else 1]
tokens = 128 if gpu else 4

def rate(engine, params, speculate=True):
    torch.cuda.synchronize() if gpu else None
    t, n = time.perf_counter(), 0
    for p in prompts:
        req = engine.add_request(p, params, speculate=speculate)
        while engine.scheduler.has_work():
            engine.step()
        n += len(req.output_ids)
    return n / (time.perf_counter() - t)

for name in ("dflash", "eagle3", "gemma4_mtp"):
    engine = Engine(cuda_spec(SHIPPED[name], 1), draft_policy="auto")
    base = engine.with_method({"method": "none"})
    greedy = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    hot = SamplingParams(max_new_tokens=tokens, ignore_eos=True, temperature=1.0, seed=1)
    for _ in range(2):  # the second pass is the steady state
        plain, none = rate(engine, greedy, speculate=False), rate(base, greedy)
        auto1, none1 = rate(engine, hot), rate(base, hot)
    print(f"{name}: never drafting {plain:.0f} tok/s vs none {none:.0f} ({plain / none:.2f}x); "
          f"auto T=1 {auto1:.0f} vs none {none1:.0f} ({auto1 / none1:.2f}x)", flush=True)
