"""Does drafting change a single output token on the GPU? The shipped trained pair, `backend:
cuda`, bf16, greedy: for each method and batch size, how many prompts' outputs with drafting
equal `none`'s in the same engine, how many equal the same prompt run alone, and how many
equal `none`'s with the draft policy `auto` (which turns drafting on and off by batch size),
with ``model.batch_invariant`` off and on. ``--temperature`` above 0 samples instead, each
prompt with its own seed: the same counts for seeded sampled requests.

`python bench/identity.py [--batches 1,4,16] [--prompts 32] [--tokens 128] [--invariant off,on]
[--temperature 0] [--depths 2] [--feed static|continuous]` (CUDA machine; without one the cuda
backend runs in Triton's interpreter in float32, which checks only that the tool runs). ``--depths``: the
pipeline depths (rounds in flight) of the drafting engines, each measured in turn. ``--feed
continuous``: every prompt in one generate call through ``batch`` slots (engines built for each
batch size), so finished requests' slots take new prompts while the others run, as a server's
do; static (the default): one call per ``batch`` prompts."""

from __future__ import annotations

import argparse
import itertools

from draftline.core.benchmark import SHIPPED, cuda_spec, interpret_without_gpu
from draftline.core.engine import Engine
from draftline.core.sampling import SamplingParams
from draftline.core.training.corpus import read_prompts


def _spec(path: str, invariant: bool, max_batch: int, depth: int = 2):
    return cuda_spec(path, max_batch, depth, dtype="bfloat16", batch_invariant=invariant)


def _outputs(engine: Engine, prompts: list[str], batch: int, params: list[SamplingParams]) -> list[list[int]]:
    out = []
    for i in range(0, len(prompts), batch):
        out += [c.output_ids for c in engine.generate(prompts[i : i + batch], params[i : i + batch])]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--methods", default="dflash,eagle3,gemma4_mtp")
    ap.add_argument("--invariant", default="off,on", help="model.batch_invariant settings to run")
    ap.add_argument("--temperature", type=float, default=0.0, help="above 0: seeded sampling, a seed per prompt")
    ap.add_argument("--depths", default="2", help="pipeline depths of the drafting engines (0, 1, 2)")
    ap.add_argument("--feed", choices=["static", "continuous"], default="static")
    args = ap.parse_args()
    interpret_without_gpu()
    prompts = read_prompts("specs/tiny/eval_prompts.jsonl")[: args.prompts]
    params = [SamplingParams(max_new_tokens=args.tokens, ignore_eos=True, temperature=args.temperature, seed=1000 + i)
              for i in range(len(prompts))]
    batches = [int(b) for b in args.batches.split(",")]
    n = len(prompts)
    print(f"temperature {args.temperature}")
    print(f"{'method':<11}{'invariant':>10}{'depth':>6}{'batch':>6}{'= none':>9}{'= alone':>9}{'none = alone':>14}"
          f"{'auto = none':>13}")
    for name, invariant, depth in itertools.product(args.methods.split(","), [m == "on" for m in args.invariant.split(",")],
                                                [int(d) for d in args.depths.split(",")]):
        alone = None
        for slots in [max(batches)] if args.feed == "static" else batches:  # one engine, or one a batch size
            engine = Engine(_spec(SHIPPED[name], invariant, slots, depth), draft_policy="always")
            base = engine.with_method({"method": "none"})
            auto = Engine(engine.spec, target=engine.target, tokenizer=engine.tokenizer, draft_policy="auto")
            alone = alone or _outputs(base, prompts, 1, params)
            for batch in batches if args.feed == "static" else [slots]:
                per_call = batch if args.feed == "static" else len(prompts)
                spec, plain = _outputs(engine, prompts, per_call, params), _outputs(base, prompts, per_call, params)
                policy = _outputs(auto, prompts, per_call, params)
                counts = [sum(a == b for a, b in zip(x, y)) for x, y in
                          ((spec, plain), (spec, alone), (plain, alone), (policy, plain))]
                print(f"{name:<11}{invariant!s:>10}{depth:>6}{batch:>6}{counts[0]:>5}/{n:<3}{counts[1]:>5}/{n:<3}"
                      f"{counts[2]:>10}/{n:<3}{counts[3]:>9}/{n:<3}", flush=True)
            del engine, base, auto


if __name__ == "__main__":
    main()
