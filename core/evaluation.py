"""`draftline eval`: a method against `none` on held-out prompts, in one run, same backend.

Prompts run one at a time (batch 1), alternating method and baseline so that machine drift
falls on both alike. At temperature 0 every output must equal the baseline's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .engine import Completion, Engine
from .sampling import SamplingParams


@dataclass
class Tally:
    """Aggregates over a method's completions at one temperature."""

    k: int
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    round_tokens: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)
    round_lengths: list[int] = field(default_factory=list)  # tokens emitted per round (the τ distribution)

    def add(self, c: Completion, seconds: float) -> None:
        self.tokens += len(c.output_ids)
        self.seconds += seconds
        self.per_pos = self.per_pos or [0] * self.k
        for r in c.rounds or []:
            self.rounds += 1
            self.round_tokens += r.accepted + 1
            self.accepted += r.accepted
            self.round_lengths.append(r.accepted + 1)
            for i in range(r.accepted):
                self.per_pos[i] += 1

    def summary(self) -> dict[str, Any]:
        rounds = max(1, self.rounds)
        return {
            "tau": round(self.round_tokens / rounds, 3),
            "accept_rate": round(self.accepted / max(1, self.rounds * self.k), 4) if self.k else 0.0,
            "accept_per_pos": [round(a / rounds, 4) for a in self.per_pos],
            "tokens": self.tokens,
            "rounds": self.rounds,
            "tokens_per_s": round(self.tokens / self.seconds, 2) if self.seconds else 0.0,
        }


def _timed(engine: Engine, prompt: str, params: SamplingParams) -> tuple[Completion, float]:
    start = time.perf_counter()
    out = engine.generate([prompt], params, trace=True)[0]
    return out, time.perf_counter() - start


def evaluate(engine: Engine, prompts: list[str], temperature: float, max_new_tokens: int, seed: int) -> dict:
    baseline = engine.with_method({"method": "none"})
    warm = SamplingParams(max_new_tokens=4)
    engine.generate(prompts[:1], warm), baseline.generate(prompts[:1], warm)
    spec, base = Tally(engine.plan.num_speculative_tokens), Tally(0)
    mismatches = 0
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed + i)
        a, ta = _timed(engine, prompt, params)
        b, tb = _timed(baseline, prompt, params)
        spec.add(a, ta)
        base.add(b, tb)
        mismatches += a.output_ids != b.output_ids
    s, n = spec.summary(), base.summary()
    return {
        "temperature": temperature,
        "method": engine.plan.method,
        "prompts": len(prompts),
        **s,
        "baseline_tokens_per_s": n["tokens_per_s"],
        "speedup": round(s["tokens_per_s"] / n["tokens_per_s"], 3) if n["tokens_per_s"] else None,
        "lossless_check": "n/a (sampled)" if temperature > 0 else f"{len(prompts) - mismatches}/{len(prompts)} identical",
        "round_lengths": spec.round_lengths,
    }


def format_table(results: list[dict]) -> str:
    head = f"{'temp':>5} {'method':>8} {'tau':>6} {'accept':>7} {'tok/s':>8} {'none tok/s':>10} {'speedup':>8}  lossless"
    rows = [head]
    for r in results:
        rows.append(
            f"{r['temperature']:>5} {r['method']:>8} {r['tau']:>6.2f} {r['accept_rate']:>7.1%} {r['tokens_per_s']:>8.1f} "
            f"{r['baseline_tokens_per_s']:>10.1f} {r['speedup']:>7.2f}x  {r['lossless_check']}"
        )
        pos = " ".join(f"{p:.2f}" for p in r["accept_per_pos"])
        rows.append(f"      per-position acceptance: {pos}")
    return "\n".join(rows)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        k, name = len(r["accept_per_pos"]), f"{r['method']} T={r['temperature']}"
        left.plot(range(1, k + 1), r["accept_per_pos"], marker="o", label=f"{name} (τ={r['tau']:.2f})")
        n = max(1, len(r["round_lengths"]))  # each run's bars sum to 1: runs of different lengths compare
        right.hist(r["round_lengths"], bins=range(1, k + 3), weights=[1 / n] * len(r["round_lengths"]),
                   alpha=0.5, align="left", label=name)
    left.set(xlabel="draft position", ylabel="fraction of rounds accepted", title="Per-position acceptance", ylim=(0, 1))
    right.set(xlabel="tokens emitted per round", ylabel="fraction of rounds", title="τ distribution")
    for ax in (left, right):
        ax.legend()
        ax.grid(alpha=0.3)
    methods = " / ".join(dict.fromkeys(r["method"] for r in results))
    fig.suptitle(f"{methods} vs none, {results[0]['prompts']} held-out prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
