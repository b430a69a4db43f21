"""`draftline eval`: methods against `none` on a dataset's prompts, in one run, same backend.

Prompts run one at a time (batch 1), alternating method and baseline so that machine drift
falls on both alike. At temperature 0 every output must equal the baseline's. The method runs
under the spec's draft policy (`auto` by default: drafting only where it pays), each dataset
and temperature with a policy of its own, so what one run measured does not steer the next.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from .datasets import Dataset
from .engine import Completion, Engine
from .grammar import Constraint
from .sampling import SamplingParams


@dataclass
class Tally:
    """Aggregates over a method's completions at one temperature."""

    k: int
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0  # every round, plain ones included
    drafted: int = 0  # rounds that drafted: τ and acceptance are theirs
    round_tokens: int = 0  # tokens the drafted rounds emitted
    accepted: int = 0
    proposed: int = 0
    per_pos: list[int] = field(default_factory=list)  # [K] rounds that accepted draft i
    reached: list[int] = field(default_factory=list)  # [K] rounds that drafted position i (narrower ones stop short)
    round_lengths: list[int] = field(default_factory=list)  # tokens emitted per drafted round (the τ distribution)

    def add(self, c: Completion, seconds: float) -> None:
        self.tokens += len(c.output_ids)
        self.seconds += seconds
        self.per_pos = self.per_pos or [0] * self.k
        self.reached = self.reached or [0] * self.k
        for r in c.rounds or []:
            self.rounds += 1
            if not r.drafted:
                continue
            self.drafted += 1
            self.round_tokens += r.accepted + 1
            self.accepted += r.accepted
            self.proposed += len(r.drafted)
            self.round_lengths.append(r.accepted + 1)
            for i in range(len(r.drafted)):
                self.reached[i] += 1
                self.per_pos[i] += i < r.accepted

    def summary(self) -> dict[str, Any]:
        return {
            "tau": round(self.round_tokens / self.drafted, 3) if self.drafted else 1.0,
            "accept_rate": round(self.accepted / self.proposed, 4) if self.proposed else 0.0,
            "accept_per_pos": [round(a / n, 4) if n else 0.0 for a, n in zip(self.per_pos, self.reached)],
            "drafted_share": round(self.drafted / self.rounds, 4) if self.rounds else 0.0,
            "tokens": self.tokens,
            "rounds": self.rounds,
            "tokens_per_s": round(self.tokens / self.seconds, 2) if self.seconds else 0.0,
        }


def _timed(engine: Engine, prompt: str, params: SamplingParams) -> tuple[Completion, float]:
    start = time.perf_counter()
    out = engine.generate([prompt], params, trace=True)[0]
    return out, time.perf_counter() - start


def evaluate(engine: Engine, dataset: Dataset, temperature: float, max_new_tokens: int, seed: int,
             constraint: Constraint | None = None) -> dict:
    """One method over ``dataset`` at one temperature, against `none` on the same prompts, both
    held to ``constraint`` when one is given. ``engine`` should be fresh: its draft policy
    learns from this run only."""
    prompts = dataset.prompts
    baseline = engine.with_method({"method": "none"})
    warm = SamplingParams(max_new_tokens=4, constraint=constraint)  # a constraint compiled before timing
    engine.generate(list(prompts[:1]), warm), baseline.generate(list(prompts[:1]), warm)
    spec, base, free = Tally(engine.plan.num_speculative_tokens), Tally(0), Tally(0)
    identical = refused = replaced = parsed = 0
    mask_ms = []  # host ms a round spent on grammar masks, per prompt
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed + i,
                                constraint=constraint)
        a, ta = _timed(engine, prompt, params)
        b, tb = _timed(baseline, prompt, params)
        spec.add(a, ta)
        base.add(b, tb)
        identical += a.output_ids == b.output_ids
        refused += a.meta_info.get("grammar_refused_drafts", 0)
        replaced += a.meta_info.get("grammar_replaced_drafts", 0)
        mask_ms.append(a.meta_info.get("grammar_mask_ms_per_round", 0.0))
        if constraint is not None:  # the grammar's cost: `none` free of it, as many tokens as it gave
            free.add(*_timed(baseline, prompt, SamplingParams(temperature=temperature, seed=seed + i, ignore_eos=True,
                                                              max_new_tokens=max(1, len(b.output_ids)))))
            parsed += _valid(a.text, constraint)
    s, n = spec.summary(), base.summary()
    return {
        "dataset": dataset.name if constraint is None else f"{dataset.name}+{constraint.kind}",
        **({} if constraint is None else {"grammar_refused_drafts": refused, "grammar_replaced_drafts": replaced,
                                         "json_valid": parsed,
                                         "grammar_mask_ms_per_round": round(sum(mask_ms) / len(mask_ms), 4),
                                         **_grammar_cost(n, free.summary())}),
        "temperature": temperature,
        "method": engine.plan.method,
        "draft_policy": str(engine.policy.limit),
        "prompts": len(prompts),
        **s,
        "baseline_tokens_per_s": n["tokens_per_s"],
        "speedup": round(s["tokens_per_s"] / n["tokens_per_s"], 3) if n["tokens_per_s"] else None,
        "identical": identical if temperature == 0 else None,
        "lossless_check": "n/a (sampled)" if temperature > 0 else f"{identical}/{len(prompts)} identical",
        "round_lengths": spec.round_lengths,
    }


def _grammar_cost(held: dict, free: dict) -> dict:
    """Constrained `none` against `none` free of the grammar over the same prompts and as many
    tokens a prompt (a grammar's outputs end where it does, so a run to max_new_tokens would
    spread each request's fixed costs over more tokens)."""
    ratio = held["tokens_per_s"] / free["tokens_per_s"] if free["tokens_per_s"] else None
    return {"free_baseline_tokens_per_s": free["tokens_per_s"],
            "grammar_keeps": None if ratio is None else round(ratio, 3)}


def _valid(text: str, constraint: Constraint) -> bool:
    """The output is JSON, and valid for the constraint's schema where jsonschema is installed."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:
        return True
    try:
        jsonschema.validate(value, json.loads(constraint.source) if constraint.kind == "json_schema" else {})
    except jsonschema.ValidationError:
        return False
    return True


def lossy(results: list[dict]) -> list[dict]:
    """Greedy runs whose outputs differ from `none`'s: a broken lossless guarantee."""
    return [r for r in results if r["temperature"] == 0 and r["identical"] != r["prompts"]]


def format_table(results: list[dict]) -> str:
    head = (f"{'dataset':>12} {'temp':>5} {'method':>10} {'tau':>6} {'accept':>7} {'drafted':>8} {'tok/s':>8} "
            f"{'none tok/s':>10} {'speedup':>8}  lossless")
    rows = [head]
    for r in results:
        rows.append(
            f"{r['dataset']:>12} {r['temperature']:>5} {r['method']:>10} {r['tau']:>6.2f} {r['accept_rate']:>7.1%} "
            f"{r['drafted_share']:>8.1%} {r['tokens_per_s']:>8.1f} {r['baseline_tokens_per_s']:>10.1f} "
            f"{r['speedup']:>7.2f}x  {r['lossless_check']}"
        )
        pos = " ".join(f"{p:.2f}" for p in r["accept_per_pos"])
        grammar = "" if "grammar_refused_drafts" not in r else (
            f"; the grammar refused {r['grammar_refused_drafts']} drafts and replaced "
            f"{r['grammar_replaced_drafts']} by the drafter's best allowed; "
            f"{r['json_valid']}/{r['prompts']} outputs "
            f"valid JSON; masks {r['grammar_mask_ms_per_round']:.3f} ms a round; constrained `none` "
            f"{r['baseline_tokens_per_s']:.1f} tok/s against {r['free_baseline_tokens_per_s']:.1f} free of the "
            f"grammar at the same lengths ({r['grammar_keeps']})")
        rows.append(f"{'':>12} per-position acceptance: {pos}{grammar}")
    return "\n".join(rows)


def paper_table(results: list[dict]) -> str:
    """The DFlash paper's Table 1 layout in Markdown: per temperature, a row per method and,
    per dataset, its speedup over `none` and τ."""
    datasets = list(dict.fromkeys(r["dataset"] for r in results))
    cells = {(r["temperature"], r["method"], r["dataset"]): r for r in results}
    lines = []
    for temp in dict.fromkeys(r["temperature"] for r in results):
        lines += [f"Temperature = {temp:g}", "",
                  "| method | " + " | ".join(f"{d} speedup | {d} τ" for d in datasets) + " |",
                  "|---|" + "---|---|" * len(datasets)]
        for method in dict.fromkeys(r["method"] for r in results if r["temperature"] == temp):
            row = [cells.get((temp, method, d)) for d in datasets]
            lines.append(f"| {method} | " + " | ".join(
                f"{c['speedup']:.2f}x | {c['tau']:.2f}" if c else "- | -" for c in row) + " |")
        lines.append("")
    return "\n".join(lines).rstrip()


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        k, name = len(r["accept_per_pos"]), f"{r['method']} {r['dataset']} T={r['temperature']}"
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
    datasets = " / ".join(dict.fromkeys(r["dataset"] for r in results))
    fig.suptitle(f"{methods} vs none, {datasets}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
