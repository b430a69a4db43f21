"""The draft policy and the machine's round timing, offline: the real Machine, Scheduler and
DraftPolicy over a stand-in device whose rounds cost what each verify width cost on an H200
(8B DFlash at 32 rows, `bash bench/width_bench.sh 32,64`), with closed-loop clients.

`python bench/policy_sim.py [HOST_MS_PER_STEP]` (CPU; about 10 s). Launches queue on a virtual
stream (a launch completes its cost after the previous one, or after now), collect sleeps until
then, and each step may add host time. It prints tok/s and, per verify width at the 32-row
bucket, the round time the policy measured beside the device's, so a change to the machine's
timing or to the policy can be checked against known costs before a GPU run: with a steady host
the measured times match the device's (plain decoding's reads the host where the host is slower).
"""
from __future__ import annotations

import random
import sys
import time

from draftline.core.contract import RoundResult
from draftline.core.machine import Machine, Plan
from draftline.core.policy import DraftPolicy
from draftline.core.request import Request, SpecStats
from draftline.core.sampling import SamplingParams
from draftline.core.scheduler import Scheduler
from draftline.core.simulated import accepted_runs
from draftline.core.stops import Stops

ROUND_S = {1: .0062, 2: .0088, 4: .0097, 8: .0126, 16: .0181}  # seconds a round at 32 rows, by verify width
RATE = 0.86  # each draft accepted given the one before (dflash-paper)
TAU = {w: sum(RATE ** i for i in range(w)) for w in ROUND_S}


class Device:
    """Rounds and prefills on a virtual stream, their results drawn at the profile's rate."""

    name, max_depth, prefill_beside = "simulated", 2, False

    def __init__(self, seed: int = 0):
        self.free_at, self.rng = 0.0, random.Random(seed)

    def _enqueue(self, seconds: float) -> float:
        self.free_at = max(time.perf_counter(), self.free_at) + seconds
        return self.free_at

    def verify_widths(self, rows: int) -> tuple[int, ...]:
        return (16, 8, 4, 2)

    def prefill(self, reqs, ends):
        for req, end in zip(reqs, ends):
            req.prefilled = end
        n = len(reqs)
        return self._enqueue(0.002 + 0.0005 * n), RoundResult([True] * n, [0] * n, [[7]] * n, [[]] * n)

    def launch(self, reqs, width):
        seconds = ROUND_S[width] * (0.95 + 0.1 * self.rng.random())
        accepted = accepted_runs(self.rng, len(reqs), width, RATE)
        return self._enqueue(seconds), RoundResult([True] * len(reqs), accepted, [[7] * (a + 1) for a in accepted],
                                                   [[5] * (width - 1) for _ in reqs], device_s=seconds)

    def collect(self, handle):
        done, result = handle
        time.sleep(max(0.0, done - time.perf_counter()))  # one wait, as a device sync releases the GIL once
        return result

    def free(self, req) -> None:
        pass


def main(host_s: float = 0.0, streams: int = 32, requests: int = 256, new_tokens: int = 256) -> None:
    scheduler, policy = Scheduler(streams, 8192), DraftPolicy("auto")
    machine = Machine(Plan("dflash", "parallel", 15), Device(), scheduler, policy, Stops(lambda ids: ""), depth=2)
    sent = 0

    def send() -> None:
        nonlocal sent
        scheduler.add(Request(rid=sent, prompt_ids=[1] * 128, params=SamplingParams(max_new_tokens=new_tokens,
                              ignore_eos=True), stop_ids=frozenset(), max_model_len=1024, stats=SpecStats(15)))
        sent += 1

    for _ in range(streams):
        send()
    start = time.perf_counter()
    while scheduler.has_work():
        finished = machine.step()
        time.sleep(host_s)
        for _ in finished:
            if sent < requests:
                send()
    print(f"{requests * new_tokens / (time.perf_counter() - start):.0f} tok/s over {machine.clock.rounds} rounds, "
          f"host {1e3 * host_s:.1f} ms a step")
    for row in policy.table():
        if row["batch_bucket"] == streams:
            measured = row["ms_per_token"] * TAU[row["width"]]
            print(f"width {row['width']:>2}: {row['rounds']:>4} rounds, measured {measured:6.2f} ms a round, "
                  f"device {1e3 * ROUND_S[row['width']]:6.2f}{'  chosen' if row['chosen'] else ''}")


if __name__ == "__main__":
    main(float(sys.argv[1]) / 1e3 if len(sys.argv) > 1 else 0.0)
