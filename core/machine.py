"""The draft -> verify -> accept state machine: phases and transitions as data, the plan a
method compiles to, and the step loop a backend executes."""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Literal

import torch

from .policy import DraftPolicy
from .request import Request, Round

if TYPE_CHECKING:
    from backends.base import Backend

    from .scheduler import Scheduler


class Phase(str, Enum):
    WAITING = "WAITING"
    PREFILL = "PREFILL"
    DRAFT = "DRAFT"
    VERIFY = "VERIFY"
    ACCEPT = "ACCEPT"
    FINISHED = "FINISHED"


# phase -> phases it may move to; anything else is a bug and raises. Every phase may end in
# FINISHED: a stop, a cancellation, or a failure of that request alone.
TRANSITIONS: dict[Phase, tuple[Phase, ...]] = {
    Phase.WAITING: (Phase.PREFILL, Phase.FINISHED),
    Phase.PREFILL: (Phase.DRAFT, Phase.FINISHED),
    Phase.DRAFT: (Phase.VERIFY, Phase.FINISHED),
    Phase.VERIFY: (Phase.ACCEPT, Phase.FINISHED),
    Phase.ACCEPT: (Phase.DRAFT, Phase.FINISHED),
    Phase.FINISHED: (),
}


class TransitionError(RuntimeError):
    pass


def advance(req: Request, to: Phase) -> None:
    if to not in TRANSITIONS[req.phase]:
        raise TransitionError(f"request {req.rid}: illegal transition {req.phase.value} -> {to.value}")
    req.phase = to


def abort(req: Request, message: str) -> None:
    if req.phase is not Phase.FINISHED:
        req.finish({"type": "abort", "message": message})
        advance(req, Phase.FINISHED)


@dataclass(frozen=True)
class Plan:
    """What a method compiles to: everything a backend needs to run its machine."""

    method: str
    drafting: Literal["none", "parallel", "chain"]  # block in one forward, or K chained steps
    num_speculative_tokens: int  # K; verify runs K + 1 tokens per request
    target_layer_ids: tuple[int, ...] = ()  # target layers whose output hidden states it taps
    drafter_kv: Literal["none", "own", "shared"] = "none"
    draft_sample_method: str = "greedy"
    block_size: int | None = None
    drafter: str = ""  # a one-line description of the drafter's weights

    def describe(self) -> list[str]:
        lines = [
            f"method:               {self.method}",
            f"drafting:             {self.drafting}",
            f"K (drafts/round):     {self.num_speculative_tokens}",
            f"verify width:         {self.num_speculative_tokens + 1} tokens per request",
        ]
        if self.block_size is not None:
            lines.append(f"block size:           {self.block_size}")
        lines += [
            f"target layers tapped: {list(self.target_layer_ids) or 'none'}",
            f"drafter KV:           {self.drafter_kv}",
            f"draft sampling:       {self.draft_sample_method}",
        ]
        if self.drafter:
            lines.append(f"drafter:              {self.drafter}")
        return lines


def describe_transitions() -> list[str]:
    return [f"{p.value:<8} -> {' | '.join(t.value for t in nxt) or '(end)'}" for p, nxt in TRANSITIONS.items()]


class Machine:
    """Runs one step: prefill the newly admitted, one round for every running request."""

    def __init__(self, plan: Plan, backend: "Backend", scheduler: "Scheduler", policy: DraftPolicy):
        self.plan, self.backend, self.scheduler, self.policy = plan, backend, scheduler, policy

    def step(self) -> list[Request]:
        admitted, running = self.scheduler.schedule()
        if admitted:
            self._prefill(admitted)
        drafting = bool(running) and self.plan.num_speculative_tokens > 0 and self.policy.should_draft(len(running))
        for group, draft in (([r for r in running if drafting and r.speculate], True),
                             ([r for r in running if not (drafting and r.speculate)], False)):
            if group:
                self._timed_round(group, draft)
        return self.scheduler.reap(self.backend.free)

    def _prefill(self, reqs: list[Request]) -> None:
        for req in reqs:
            advance(req, Phase.PREFILL)
        for req, token in zip(reqs, self.backend.prefill(reqs)):
            if token is None:
                abort(req, "non-finite logits in prefill")
                continue
            req.emit([token])
            advance(req, Phase.FINISHED if req.finish_reason else Phase.DRAFT)

    def _timed_round(self, reqs: list[Request], draft: bool) -> None:
        start, before = time.perf_counter(), sum(len(r.output_ids) for r in reqs)
        self._round(reqs, draft)
        emitted = sum(len(r.output_ids) for r in reqs) - before
        self.policy.record(len(reqs), draft, time.perf_counter() - start, emitted)

    def _round(self, reqs: list[Request], draft: bool) -> None:
        proposal = self.backend.draft(reqs) if draft else self.backend.skip_draft(reqs)
        for req in reqs:
            advance(req, Phase.VERIFY)
        verification = self.backend.verify(reqs, proposal)
        finite = verification.finite if verification.finite is not None else \
            torch.isfinite(verification.logits).flatten(1).all(dim=1)
        finite = finite.tolist()
        if not all(finite):  # one request's failure ends that request, never the batch
            for req, ok in zip(reqs, finite):
                if not ok:
                    abort(req, "non-finite logits in verify")
            keep = [i for i, ok in enumerate(finite) if ok]
            reqs, proposal, verification = [reqs[i] for i in keep], proposal.rows(keep), verification.rows(keep)
            if not reqs:
                return
        for req in reqs:
            advance(req, Phase.ACCEPT)
        drafted = proposal.tokens.tolist()  # one copy for the batch, not one per row; before accept(), which
        verdict = self.backend.accept(reqs, proposal, verification)  # may launch the next round into these buffers
        for i, req in enumerate(reqs):
            self._finish_round(req, drafted[i], int(verdict.num_accepted[i]), verdict.tokens[i])

    @staticmethod
    def _finish_round(req: Request, drafted: list[int], accepted: int, tokens) -> None:
        start = req.seq_len
        req.stats.record(accepted, len(drafted))
        kept = req.emit(tokens[: accepted + 1].tolist())
        if req.rounds is not None:
            req.rounds.append(Round(position=start, drafted=tuple(drafted), accepted=accepted, emitted=tuple(kept)))
        advance(req, Phase.FINISHED if req.finish_reason else Phase.DRAFT)
