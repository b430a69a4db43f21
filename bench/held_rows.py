"""What holding a request out of new rounds costs and saves, offline: the real Machine, Scheduler
and Stops over a stand-in device on a virtual clock, with closed-loop streams of the serving
benchmark's shape (issue 22's: 128-token prompts, 256 new tokens, 8 x streams requests).

With rounds in flight, a request near its length limit is held out of the next round when the
rounds it has in flight should end it (``Stops.done_in_flight``). If they fall short it joins a
round again, whose tokens come ``depth`` steps later: its stream sees a gap of about depth + 1
steps. If it is not held, a round past its end is work thrown away. This prints, per rule, the
streams' output rate on the virtual clock, the rows the rounds ran (a request's past its end too), the holds that
fell short, and the worst token gap over the request's median (the serving benchmark's gap x),
in steps and in time: "mean" is the rule before (held on the request's mean tokens a round),
"shipped" the one in draftline.core.stops.

`python bench/held_rows.py [--streams 64] [--width 8] [--rate 0.86] [--seeds 8] [--long-prompt 4096 --chunk 256
--prompt-ms 0.045]` (CPU, seconds; --long-prompt: one such prompt sent mid-run, prefilled in chunks, and the
worst gap opened while it was, over its stream's median;
`--streams 16 --requests 48 --new-tokens 128 --width 16 --rate 0.75 --cost 0.35,0.002 --host-ms 0.15`:
the tiny pair's 16 slots, launch-bound).
The device's round costs ROUND_MS + ROW_MS a row (the 8B DFlash spec at width 8 on an H200: 32
rows 11.4 ms, 64 rows 19.2 ms), a prefill PREFILL_MS + PROMPT_MS a prompt token (--prefill-ms,
--prompt-ms: `--prefill-ms 2.8 --prompt-ms 0.0295` are the H200's 8B prefills, 6.6 ms for one
128-token prompt and 33 for eight; `--prefill-ms 0 --prompt-ms 0.022` prices a prompt's tokens
as a 64-row round's products take them, as if they rode inside the round's forward)."""

from __future__ import annotations

import argparse
import statistics

from draftline.core.contract import RoundResult
from draftline.core.machine import Machine, Plan
from draftline.core.policy import DraftPolicy
from draftline.core.request import Request, SpecStats
from draftline.core.sampling import SamplingParams
from draftline.core.scheduler import Scheduler
from draftline.core.simulated import accepted_runs
from draftline.core.stops import Stops

ROUND_MS, ROW_MS = 3.5, 0.245
PREFILL_MS, PROMPT_MS = 1.0, 0.02
HOST_MS = 1.0  # the engine's own work a step, beside the device


class Clock:
    def __init__(self):
        self.now = 0.0  # ms


class Device:
    """Launches queue on one virtual stream; collecting one moves the clock to its end."""

    name, max_depth, prefill_beside = "stand-in", 2, False

    def __init__(self, clock: Clock, rate: float, width: int, seed: int, cost: tuple[float, float],
                 prompt_ms: float = PROMPT_MS, prefill_ms: float = PREFILL_MS):
        import random

        self.cost = cost  # (ms a round, ms a row)
        self.prompt_ms, self.prefill_ms = prompt_ms, prefill_ms  # ms a prompt token, a prefill launch's besides
        self.clock, self.rate, self.width, self.rng, self.free_at = clock, rate, width, random.Random(seed), 0.0
        self.rows_run = 0

    def _enqueue(self, ms: float) -> float:
        self.free_at = max(self.clock.now, self.free_at) + ms
        return self.free_at

    def verify_widths(self, rows: int) -> tuple[int, ...]:
        return (self.width,)

    def prefill(self, reqs, ends):
        tokens = sum(end - r.prefilled for r, end in zip(reqs, ends))
        for req, end in zip(reqs, ends):
            req.prefilled = end
        n = len(reqs)
        first = [[7] if r.prefilled >= r.prefill_len else [] for r in reqs]  # a chunk short of its prompt's end: none
        return self._enqueue(self.prefill_ms + self.prompt_ms * tokens), RoundResult([True] * n, [0] * n, first, [[]] * n)

    def launch(self, reqs, width):
        self.rows_run += len(reqs)
        accepted = accepted_runs(self.rng, len(reqs), width, self.rate)
        done = self._enqueue(self.cost[0] + self.cost[1] * len(reqs))
        return done, RoundResult([True] * len(reqs), accepted, [[7] * (a + 1) for a in accepted],
                                 [[5] * (width - 1) for _ in reqs])

    def collect(self, handle):
        done, result = handle
        self.clock.now = max(self.clock.now, done)
        return result

    def free(self, req) -> None:
        pass


class Timed(Stops):
    """Stops that note when (virtual ms) and in which step each request's tokens arrive."""

    def __init__(self, clock: Clock, machine_steps, rule: str):
        super().__init__(lambda ids: "")
        self.clock, self.steps, self.rule = clock, machine_steps, rule
        self.arrivals: dict[int, list[tuple[float, int]]] = {}

    def apply(self, req, tokens):
        kept = super().apply(req, tokens)
        if kept:
            self.arrivals.setdefault(req.rid, []).append((self.clock.now, self.steps()))
        return kept

    def done_in_flight(self, req, rounds):
        return _by_mean(req, rounds) if self.rule == "mean" else Stops.done_in_flight(req, rounds)


def _by_mean(req: Request, rounds: int) -> bool:
    """The rule before: the rounds in flight each emitting the request's mean tokens a round."""
    stats, out = req.stats, len(req.output_ids)
    expected = out + rounds * (max(1.0, stats.round_tokens / stats.verify_ct) if stats.verify_ct else 1.0)
    return expected >= req.params.max_new_tokens or len(req.prompt_ids) + expected >= req.max_model_len


def run(rule: str, streams: int, width: int, rate: float, seed: int, new_tokens: int = 256, requests: int = 0,
        cost: tuple[float, float] = (ROUND_MS, ROW_MS), host_ms: float = HOST_MS, long_prompt: int = 0,
        chunk: int = 256, prompt_ms: float = PROMPT_MS, prefill_ms: float = PREFILL_MS) -> dict:
    clock = Clock()
    device = Device(clock, rate, width, seed, cost, prompt_ms, prefill_ms)
    # with a long prompt, prefills go in chunks of at most ``chunk`` tokens a step (--max-num-batched-tokens)
    scheduler = Scheduler(streams + 1, chunk, chunked=True) if long_prompt else Scheduler(streams, 8192)
    holder: list[Machine] = []
    stops = Timed(clock, lambda: holder[0].steps, rule)
    machine = Machine(Plan("dflash", "parallel", width - 1), device, scheduler, DraftPolicy("always"), stops, depth=2)
    holder.append(machine)
    total, sent = requests or 8 * streams, 0

    def send() -> None:
        nonlocal sent
        scheduler.add(Request(rid=sent, prompt_ids=[1] * 128, params=SamplingParams(max_new_tokens=new_tokens,
                              ignore_eos=True), stop_ids=frozenset(), max_model_len=1024, stats=SpecStats(width - 1)))
        sent += 1

    for _ in range(streams if not requests else total):  # --requests: every one queued at once (Engine.generate)
        send()
    long = None
    while scheduler.has_work():
        if long_prompt and long is None and sent >= total // 2:  # mid-run, into the running streams
            long = Request(rid=-1, prompt_ids=[1] * long_prompt, params=SamplingParams(max_new_tokens=new_tokens,
                           ignore_eos=True), stop_ids=frozenset(), max_model_len=long_prompt + 2 * new_tokens,
                           stats=SpecStats(width - 1))
            scheduler.add(long)
            window = [clock.now, None]
        finished = machine.step()
        clock.now += host_ms
        if long is not None and window[1] is None and long.output_ids:
            window[1] = stops.arrivals[-1][0][0]
        for _ in finished:
            if sent < total and not requests:
                send()
    window = tuple(window) if long is not None else None
    return {"tok/s": total * new_tokens / clock.now * 1e3, "rounds": machine.clock.rounds, "rows": device.rows_run,
            **_gaps(stops.arrivals, window), "long prefill ms": window[1] - window[0] if window else 0.0}


def _gaps(arrivals: dict[int, list[tuple[float, int]]], window: tuple[float, float] | None) -> dict:
    """From each stream's (ms, step) token arrivals (rid -1: the long prompt's, left out): its
    worst gap over its median, in ms and steps; the gaps of over two steps (a hold fell short);
    and the worst gap opened inside ``window`` (the long prompt's prefill) over its median."""
    gaps_t, gaps_s, short, during = [], [], 0, [1.0]
    for rid, times in arrivals.items():
        if rid < 0:
            continue
        dt = [b[0] - a[0] for a, b in zip(times, times[1:])]
        ds = [b[1] - a[1] for a, b in zip(times, times[1:])]
        gaps_t.append(max(dt) / statistics.median(dt))
        gaps_s.append(max(ds))
        short += sum(d > 2 for d in ds)
        if window is not None:
            during += [d / statistics.median(dt) for (a, _), d in zip(times, dt) if window[0] <= a < window[1]]
    return {"short": short, "gap x p50": statistics.median(gaps_t), "gap x max": max(gaps_t),
            "gap steps max": max(gaps_s), "streams with a gap > 2 steps": sum(g > 2 for g in gaps_s),
            "long gap x": max(during)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--rate", type=float, default=0.86)
    ap.add_argument("--seeds", type=int, default=8, help="runs per rule, each its own draws (means are printed)")
    ap.add_argument("--requests", type=int, default=0, help="queue this many at once instead of closed-loop streams")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--cost", default=f"{ROUND_MS},{ROW_MS}", help="ms a round, ms a row")
    ap.add_argument("--host-ms", type=float, default=HOST_MS, help="the engine's own work a step")
    ap.add_argument("--long-prompt", type=int, default=0, help="a prompt of this many tokens sent mid-run")
    ap.add_argument("--chunk", type=int, default=256, help="with --long-prompt: prefill tokens a step at most")
    ap.add_argument("--prompt-ms", type=float, default=PROMPT_MS, help="a prefill's ms a prompt token")
    ap.add_argument("--prefill-ms", type=float, default=PREFILL_MS, help="a prefill launch's ms besides its tokens")
    args = ap.parse_args()
    cost = tuple(map(float, args.cost.split(",")))
    print(f"{'rule':<9}{'tok/s':>8}{'rounds':>8}{'rows':>8}{'short':>7}{'gap x p50':>11}{'gap x max':>11}"
          f"{'steps max':>11}{'streams > 2 steps':>19}" + (f"{'long gap x':>12}{'its prefill ms':>16}" if args.long_prompt else ""))
    for rule in ("mean", "shipped"):
        runs = [run(rule, args.streams, args.width, args.rate, seed, args.new_tokens, args.requests, cost, args.host_ms,
                    args.long_prompt, args.chunk, args.prompt_ms, args.prefill_ms) for seed in range(args.seeds)]
        m = {k: statistics.mean(r[k] for r in runs) for k in runs[0]}
        print(f"{rule:<9}{m['tok/s']:>8.0f}{m['rounds']:>8.1f}{m['rows']:>8.0f}{m['short']:>7.1f}{m['gap x p50']:>11.2f}"
              f"{m['gap x max']:>11.2f}{max(r['gap steps max'] for r in runs):>11}"
              f"{m['streams with a gap > 2 steps']:>19.1f}"
              + (f"{m['long gap x']:>12.2f}{m['long prefill ms']:>16.1f}" if args.long_prompt else ""), flush=True)


if __name__ == "__main__":
    main()
