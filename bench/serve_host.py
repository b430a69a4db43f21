"""What the serving path's host sustains on its own: the real server (FastAPI, uvicorn, the
engine loop, the machine, scheduler, stops, detokenizer and streaming) over a stand-in device
that answers every round at once, each row accepting drafts at a fixed rate, with the same
HTTP clients as bench-serve in a process of their own.

`python bench/serve_host.py [CONCURRENCY,...] [--profile] [--timed [--releases N]]` (CPU; the tiny spec's
tokenizer). Output tok/s here is the host's ceiling at each concurrency: a GPU run that falls below
it as concurrency grows is bound by its rounds, one that sits at it by the host. --profile prints
the engine thread's heaviest functions (cProfile) at the last level.

--releases N (with --timed): the stand-in's launch lets go of the GIL N times, as the CUDA
calls of a real round's host work do (graph replay, copies, events); each one lets the HTTP side's
work for every stream in before the engine thread goes on.

--timed serves over policy_sim's device instead, whose rounds take the H200's time for each verify
width at 32 rows (the collect sleeps, releasing the GIL as a device sync does), with the `auto`
policy, and prints the policy's measured round time beside the device's: what the HTTP side's
share of the process does to the engine thread's timing and throughput.
"""
from __future__ import annotations

import cProfile
import pstats
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from draftline.api import load
from draftline.api.server import background
from draftline.core.benchmark import random_prompts
from draftline.core.contract import RoundResult
from draftline.core.engine import Engine
from draftline.core.simulated import accepted_runs
from draftline.core.spec import load_spec
from policy_sim import ROUND_S, TAU, Device  # bench/, beside this script
from trace_rounds import quantiles

RATE = 0.7  # each draft accepted given the one before


class InstantDevice:
    """Rounds and prefills decided at once: random tokens, drafts accepted at RATE."""

    name, max_depth, prefill_beside = "instant", 2, False

    def __init__(self, vocab: int, k: int):
        self.vocab, self.k, self.rng = vocab, k, random.Random(0)

    def verify_widths(self, rows: int) -> tuple[int, ...]:
        return (self.k + 1,)

    def prefill(self, reqs, ends):
        for req, end in zip(reqs, ends):
            req.prefilled = end
        n = len(reqs)
        return RoundResult([True] * n, [0] * n, [[self.rng.randrange(3, self.vocab)] for _ in reqs], [[]] * n)

    def launch(self, reqs, width):
        accepted = accepted_runs(self.rng, len(reqs), width, RATE)
        tokens = [[self.rng.randrange(3, self.vocab) for _ in range(a + 1)] for a in accepted]
        return RoundResult([True] * len(reqs), accepted, tokens, [[5] * (width - 1) for _ in reqs])

    def collect(self, handle):
        return handle

    def free(self, req) -> None:
        pass


class ReleasingDevice(Device):
    """policy_sim's device whose launch lets go of the GIL ``releases`` times."""

    def __init__(self, releases: int):
        super().__init__()
        self.releases = releases

    def launch(self, reqs, width):
        for _ in range(self.releases):
            time.sleep(0)  # a CUDA call from Python releases the GIL and takes it back
        return super().launch(reqs, width)


def main() -> None:
    levels = [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 and sys.argv[1][0].isdigit() else "32,64,128,256").split(",")]
    spec = load_spec("specs/tiny-dflash.yaml")
    spec = spec.model_copy(update={"server": spec.server.model_copy(update={"max_batch_size": max(levels)})})
    timed = "--timed" in sys.argv
    engine = Engine(spec, draft_policy="auto" if timed else "always")
    releases = int(sys.argv[sys.argv.index("--releases") + 1]) if "--releases" in sys.argv else 0
    engine.machine.backend = ReleasingDevice(releases) if timed else InstantDevice(engine.target.config.vocab_size,
                                                                  engine.plan.num_speculative_tokens)
    engine.machine.depth = 2  # the cuda backend's: rounds in flight while the host books and publishes
    prompts = random_prompts(engine.target.config.vocab_size, 64, 128, seed=0)
    profile = cProfile.Profile() if "--profile" in sys.argv else None
    with background(spec, engine) as url, ProcessPoolExecutor(1, mp_context=get_context("spawn")) as clients:
        clients.submit(load.measure, url, prompts, 1, 2, 8, True).result()  # warm-up
        for c in levels:
            if profile is not None and c == levels[-1]:
                engine.machine.step = _profiled(engine.machine.step, profile)
            engine.machine.trace = []  # the rows each round carried: does the server hold c streams?
            row = clients.submit(load.measure, url, prompts, c, 4 * c, 256, True).result()
            rounds = [r for r in engine.machine.trace if not r["prefill"]]
            rows = sorted(r["rows"] for r in rounds)
            engine.machine.trace = None
            print(f"concurrency {c:>4}: {row['out_tok_per_s']:>9} out tok/s, TTFT p50 {row['ttft_p50_ms']} ms, "
                  f"ITL p50 {row['itl_p50_ms']} ms, tau {row['tau']}, rows a round p50 {rows[len(rows) // 2]} "
                  f"max {rows[-1]}" + (", host cycle ms " + quantiles([r["host_s"] or 0.0 for r in rounds], (0.5, 0.9))
                                       if timed else ""), flush=True)
    if timed:
        for row in engine.policy.table():
            if row["batch_bucket"] == levels[-1] and row["ms_per_token"] is not None:
                print(f"width {row['width']:>2}: {row['rounds']:>4} rounds, measured "
                      f"{row['ms_per_token'] * TAU[row['width']]:6.2f} ms a round, device "
                      f"{1e3 * ROUND_S[row['width']]:6.2f}{'  chosen' if row['chosen'] else ''}")
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)


def _profiled(step, profile: cProfile.Profile):
    def run():
        profile.enable()
        try:
            return step()
        finally:
            profile.disable()
    return run


if __name__ == "__main__":
    main()
