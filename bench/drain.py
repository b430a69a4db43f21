"""How many rounds a pass of prompts through a few slots takes, from each request's own rounds:
the rows a round carries are a list-scheduling bound. Runs each prompt on the reference
backend (any machine; greedy, 128 tokens, drafting forced on), then feeds the counts through
``--slots`` slots in order, each freed slot taking the next prompt.

`python bench/drain.py [--methods dflash,eagle3,gemma4_mtp] [--prompts 48] [--slots 16]`. Prints per
method the requests' rounds (least, mean, most) and the pass's rounds: every slot full (the
bound), in order with slots refilled at once, with ``--lost`` rounds lost a readmission (2: the
machine's depth-2 pipeline, a request's end known two rounds late), and longest first (an order
that needs each length up front)."""

from __future__ import annotations

import argparse
import heapq

from draftline.core.engine import Engine
from draftline.core.sampling import SamplingParams
from draftline.core.training.corpus import read_prompts

SPECS = {"dflash": "specs/tiny-dflash.yaml", "eagle3": "specs/tiny-eagle3.yaml", "gemma4_mtp": "specs/tiny-gemma4-mtp.yaml"}


def makespan(rounds: list[int], slots: int, lost: int = 0) -> int:
    """Rounds until the last of ``rounds`` (requests in order) ends through ``slots`` slots, a
    freed slot idle ``lost`` rounds before it takes the next request."""
    free = [0] * slots
    for r in rounds:
        heapq.heappush(free, heapq.heappop(free) + r + lost)
    return max(free) - lost


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="dflash,eagle3,gemma4_mtp")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--lost", type=int, default=2)
    args = ap.parse_args()
    prompts = read_prompts("specs/tiny/eval_prompts.jsonl")[: args.prompts]
    params = SamplingParams(max_new_tokens=128, ignore_eos=True)
    print(f"{'method':<11}{'least':>6}{'mean':>7}{'most':>6}{'full':>8}{'in order':>10}{'+ lost':>8}{'longest first':>15}")
    for name in args.methods.split(","):
        engine = Engine.from_spec(SPECS[name], draft_policy="always")
        rounds = [c.meta_info["spec_verify_ct"] for c in engine.generate(prompts, params)]
        s, lost = args.slots, args.lost
        print(f"{name:<11}{min(rounds):>6}{sum(rounds) / len(rounds):>7.1f}{max(rounds):>6}{sum(rounds) / s:>8.1f}"
              f"{makespan(rounds, s):>10}{makespan(rounds, s, lost):>8}{makespan(sorted(rounds, reverse=True), s, lost):>15}",
              flush=True)


if __name__ == "__main__":
    main()
