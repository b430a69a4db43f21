"""The engine's own host work a round, with the device taken out: `Engine.generate` over a
stand-in backend that answers every round at once from rows drawn before the run (random
tokens, drafts accepted at a fixed rate, as bench/serve_host.py's InstantDevice draws them
while it runs), so what is timed is the machine, scheduler, stops, policy and request
bookkeeping a round costs the host, and next to nothing of a backend's.

`python bench/engine_host.py [SLOTS,...] [--prompts N] [--depth D] [--profile]` (CPU): depth 2
(the cuda backend's) unless given, the tiny DFlash spec, 128 new tokens a request, each slot count
fed N prompts in one generate call (4 x the slots by default); prints µs a round and a row-round,
the best of three passes, and the rows a round carried (a slot whose request ended waits for the
rounds in flight to be collected before the next prompt takes it). --profile: the heaviest
functions of one more pass at the last slot count (cProfile)."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from draftline.core.benchmark import random_prompts
from draftline.core.contract import RoundResult
from draftline.core.engine import Engine
from draftline.core.sampling import SamplingParams
from draftline.core.spec import load_spec
from serve_host import InstantDevice  # bench/, beside this script

CANNED = 4096  # rows drawn before the run, taken in turn


class CannedDevice(InstantDevice):
    """InstantDevice's rounds, drawn before the run: a launch slices them."""

    def __init__(self, vocab: int, k: int):
        super().__init__(vocab, k)
        drawn = InstantDevice.launch(self, [None] * CANNED, k + 1)
        self.rows = list(zip(drawn.accepted, drawn.tokens, drawn.drafted))
        self.at = 0

    def launch(self, reqs, width):
        n, at = len(reqs), self.at
        rows = (self.rows * 2)[at : at + n] if at + n > CANNED else self.rows[at : at + n]
        self.at = (at + n) % CANNED
        return RoundResult([True] * n, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])


def engine_for(slots: int, depth: int = 2) -> Engine:
    spec = load_spec("specs/tiny-dflash.yaml")
    spec = spec.model_copy(update={"server": spec.server.model_copy(update={"max_batch_size": slots})})
    engine = Engine(spec, draft_policy="always")
    engine.machine.backend = CannedDevice(engine.target.config.vocab_size, engine.plan.num_speculative_tokens)
    engine.machine.depth = depth  # 2: the cuda backend's
    return engine


def passes(engine: Engine, prompts: list, params: SamplingParams, repeats: int = 3) -> tuple[float, float, float]:
    """Best (µs a round, µs a row-round, rows a round) over ``repeats`` generate calls of every prompt."""
    best = (float("inf"), float("inf"), 0.0)
    for _ in range(repeats):
        clock, trace = engine.machine.clock, []
        engine.machine.trace, rounds = trace, clock.rounds
        begin = time.perf_counter()
        engine.generate(prompts, params)
        seconds = time.perf_counter() - begin
        engine.machine.trace = None
        rows = sum(r["rows"] for r in trace if not r["prefill"])
        rounds = clock.rounds - rounds
        best = min(best, (1e6 * seconds / rounds, 1e6 * seconds / max(1, rows), rows / max(1, rounds)))
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("slots", nargs="?", default="1,16,64,256")
    ap.add_argument("--prompts", type=int, default=0, help="prompts a pass (default: 4 x the slots)")
    ap.add_argument("--depth", type=int, default=2, help="rounds in flight (the cuda backend runs 2)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    params = SamplingParams(max_new_tokens=128, ignore_eos=True)
    print(f"{'slots':>6} {'us/round':>9} {'us/row-round':>13} {'rows/round':>11}")
    for slots in [int(s) for s in args.slots.split(",")]:
        engine = engine_for(slots, args.depth)
        prompts = random_prompts(engine.target.config.vocab_size, args.prompts or 4 * slots, 64, seed=0)
        engine.generate(prompts[:slots], params)  # warm-up
        per_round, per_row, rows = passes(engine, prompts, params)
        print(f"{slots:>6} {per_round:9.1f} {per_row:13.2f} {rows:11.2f}", flush=True)
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        engine.generate(prompts, params)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
