"""The draft -> verify -> accept state machine: phases and transitions as data, the plan a
method compiles to, and the step loop a backend executes."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal

from .policy import Drafted, DraftPolicy
from .request import Request, Round
from .stops import Stops

if TYPE_CHECKING:
    from .contract import Backend, RoundResult

    from .scheduler import Scheduler


class Phase(str, Enum):
    WAITING = "WAITING"
    PREFILL = "PREFILL"
    DRAFT = "DRAFT"
    VERIFY = "VERIFY"
    ACCEPT = "ACCEPT"
    FINISHED = "FINISHED"


# phase -> phases it may move to; anything else is a bug and raises. Every phase may end in
# FINISHED: a stop, a cancellation, or a failure of that request alone. A request preempted for
# KV blocks (between rounds, none in flight) goes back to WAITING.
TRANSITIONS: dict[Phase, tuple[Phase, ...]] = {
    Phase.WAITING: (Phase.PREFILL, Phase.FINISHED),
    Phase.PREFILL: (Phase.DRAFT, Phase.WAITING, Phase.FINISHED),
    Phase.DRAFT: (Phase.VERIFY, Phase.WAITING, Phase.FINISHED),
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
            f"target layers tapped: {list(self.target_layer_ids) or 'none'}"
            + (" (the outputs of these layers, 0-based; -1: the embedding output)" if self.target_layer_ids else ""),
            f"drafter KV:           {self.drafter_kv}",
            f"draft sampling:       {self.draft_sample_method}",
        ]
        if self.drafter:
            lines.append(f"drafter:              {self.drafter}")
        return lines


def describe_transitions() -> list[str]:
    return [f"{p.value:<8} -> {' | '.join(t.value for t in nxt) or '(end)'}" for p, nxt in TRANSITIONS.items()]


@dataclass(frozen=True)
class Flight:
    """A launched round the machine has not collected yet."""

    handle: Any  # the backend's
    reqs: tuple[Request, ...]  # its rows, in order
    launched: float  # perf_counter at launch
    prefill: bool = False  # the rows' prefill: its result is each row's first token
    launch_s: float = 0.0  # a prefill's launch: the backend's host work before it returned
    ends: tuple[int, ...] = ()  # a prefill's: the prompt position each row's chunk ran to
    step: int = 0  # the machine step that launched it
    held: int = 0  # rows this step left out because their rounds in flight are expected to end them
    tokens: int = 0  # a prefill's: the prompt tokens it computes (the pacer prices them)

    @property
    def constrained(self) -> bool:
        """It carries a request under a grammar, whose next masks read this round's tokens."""
        return any(r.grammar is not None for r in self.reqs)


@dataclass
class HostClock:
    """Where the machine's time goes: its step time per round outside the waits for a round's
    (or a prefill's) result; the prefills' launches count as host work."""

    rounds: int = 0
    ahead: int = 0  # rows launched while an earlier round of theirs was still in flight
    step_s: float = 0.0  # inside step()
    wait_s: float = 0.0  # of which blocked in collect() on the device
    prefills: int = 0
    prefill_s: float = 0.0  # of which launching prefills
    preemptions: int = 0  # requests preempted for KV blocks

    @property
    def host_us_per_round(self) -> float:
        return 1e6 * (self.step_s - self.wait_s) / max(1, self.rounds)


class Machine:
    """Runs the engine's steps: prefill the newly admitted, keep rounds in flight for the
    running, collect the oldest and decide what it means for each of its requests.

    ``depth`` rounds may stay in flight for a request between steps (0: each round is launched
    and collected in the same step). A round launched for a request starts on the device where
    the last one left it, so the host books round r while rounds r+1 .. r+depth run. The
    machine alone decides which rows a round carries, when a request stops, and what a round
    collected after its request finished means: nothing."""

    def __init__(self, plan: Plan, backend: "Backend", scheduler: "Scheduler", policy: DraftPolicy,
                 stops: Stops, depth: int = 0):
        self.plan, self.backend, self.scheduler, self.policy, self.stops = plan, backend, scheduler, policy, stops
        self.depth = min(depth, backend.max_depth)
        self.flights: deque[Flight] = deque()
        self.steps = 0  # steps begun: a flight launched in step s is collected by the end of step s + depth
        self.clock = HostClock()
        self._last_collect: float | None = None
        self._host_s: float | None = None  # the host's last cycle (step to step) outside its waits for the device
        self._cycle: tuple[float, float] | None = None  # (perf_counter, clock.wait_s) at the last step's start
        self._planned: int | None = None  # a constrained batch's next width, chosen at its last launch
        self.trace: list[dict] | None = None  # set to a list: one record per collected round (bench-serve --trace-rounds)

    def step(self) -> list[Request]:
        begin = time.perf_counter()
        if self._cycle is not None:  # all the host did since the last step began, the engine loop's share too
            start, waited = self._cycle
            self._host_s = begin - start - (self.clock.wait_s - waited)
        self._cycle = (begin, self.clock.wait_s)
        self.steps += 1
        self._preempt()
        self._book_constrained()
        done = self.scheduler.reap(self.free)  # ended in _preempt's drain or those rounds: slots free to admit into
        prefills, running = self.scheduler.schedule()
        done += self.scheduler.reap(self.free)  # cancelled now: their KV goes first
        if prefills:
            self._prefill(prefills)
        launched = self._launch(self._rows(running, prefills))
        while self.flights and (not launched or self._due(self.flights[0])):
            self._collect(self.flights.popleft())
            launched = True  # one collect is progress enough when nothing could be launched
        while self.flights and all(r.phase is Phase.FINISHED for r in self.flights[0].reqs):
            self._collect(self.flights.popleft())  # rounds only stopped requests ran: the device does them anyway
        self.clock.step_s += time.perf_counter() - begin
        if not self.flights:  # idle until the next step, or synchronous: no cycle to time
            self._cycle = self._host_s = None
        return done + self.scheduler.reap(self.free)

    def _rows(self, running: list[Request], prefills: list[tuple[Request, int]]) -> list[Request]:
        """The requests this step's round may carry: the running, and those admitted now, once,
        each with its whole prompt prefilled. Where the backend runs prefills beside the rounds
        (``prefill_beside``), the rows prefilled this step join from the next one, so that this
        round runs while their prefill does; unless nothing else runs."""
        known = {id(r) for r in running}
        rows = [r for r in running + [r for r, _ in prefills if id(r) not in known]
                if r.phase is not Phase.FINISHED and r.prefilled >= r.prefill_len]
        if not (prefills and self.depth and self.backend.prefill_beside):
            return rows
        fresh = {id(r) for r, _ in prefills}
        others = [r for r in rows if id(r) not in fresh]
        return others or rows

    def _due(self, flight: Flight) -> bool:
        """Whether the oldest flight is collected now: its rows would otherwise run more than
        ``depth`` rounds ahead, or it is ``depth`` steps old. The age bound keeps the results
        the device has finished from waiting behind launches: a long prompt's chunk keeps its
        row in flight step after step, so by rows alone the machine would launch on, queue
        ever more work ahead of the streams' tokens and stall them."""
        return max(r.in_flight for r in flight.reqs) > self.depth or flight.step <= self.steps - self.depth

    def _book_constrained(self) -> None:
        """Collect every flight up to the last that carries a constrained request, before this
        step launches: its next round's masks read its grammar after its last round. So its
        next round is launched as soon as the last is booked, and runs on the device while the
        host does the rest of the engine's loop."""
        last = max((i for i, f in enumerate(self.flights) if f.constrained), default=-1)
        for _ in range(last + 1):
            self._collect(self.flights.popleft())

    def _preempt(self) -> None:
        """When the running requests' next rounds need more KV blocks than the pool has, the
        newest are preempted: the rounds in flight are collected first (so each keeps every
        token it was given), then their KV is freed and they wait again at the queue's head, to
        prefill their prompt and generated tokens anew and go on as if never stopped."""
        if not self.scheduler.victims():
            return
        while self.flights:
            self._collect(self.flights.popleft())
        for req in self.scheduler.victims():  # again: the collected rounds may have ended some
            self.backend.free(req)
            req.recomputed, req.prefilled, req.preemptions = len(req.output_ids), 0, req.preemptions + 1
            advance(req, Phase.WAITING)
            self.scheduler.requeue(req)
            self.clock.preemptions += 1

    def _prefill(self, prefills: list[tuple[Request, int]]) -> None:
        """Launch the prompts' prefill, each to its end this step (a chunk, or the rest of
        the prompt); the first tokens of those it completes are booked when it is collected,
        in order with the rounds launched behind it."""
        begin = time.perf_counter()
        reqs = [r for r, _ in prefills]
        tokens = sum(end - r.prefilled for r, end in prefills)
        for req in reqs:
            if req.phase is Phase.WAITING:
                advance(req, Phase.PREFILL)
            req.in_flight += 1
        handle = self.backend.prefill(reqs, [end for _, end in prefills])
        launched = time.perf_counter()
        self.flights.append(Flight(handle, tuple(reqs), launched, prefill=True, launch_s=launched - begin,
                                   ends=tuple(r.prefilled for r in reqs), step=self.steps,  # as the launch left them
                                   tokens=tokens))
        self.clock.prefills += 1
        self.clock.prefill_s += launched - begin
        if self.depth == 0:  # synchronous: booked now, so the rows' first round runs in this step
            self._collect(self.flights.pop())

    def _first_tokens(self, flight: Flight, result: RoundResult) -> None:
        for i, req in enumerate(flight.reqs):
            req.in_flight -= 1
            if req.phase is Phase.FINISHED:  # cancelled meanwhile
                continue
            if not result.finite[i]:
                abort(req, "non-finite logits in prefill")
                continue
            if not result.tokens[i]:  # a chunk short of the prompt's end: no token yet
                continue
            if req.grammar is not None:
                req.grammar.advance(result.tokens[i])
            self.stops.apply(req, result.tokens[i])
            advance(req, Phase.FINISHED if req.finish_reason else Phase.DRAFT)
            if req.in_flight and req.phase is Phase.DRAFT:  # its first round already runs
                advance(req, Phase.VERIFY)

    def _launch(self, running: list[Request]) -> bool:
        """Launch one round for every running request with at most ``depth`` rounds in flight
        (that may still need one): those that may draft, then the others. A request behind the
        rest (just prefilled) joins the same round and catches up a round a step, so a batch
        stays one round instead of splitting into groups that never merge again."""
        # a constrained request's next masks read its grammar after its last round: never ahead
        ready = [r for r in running if r.in_flight <= (0 if r.grammar is not None else self.depth) and not r.cancelled]
        rows = [r for r in ready if not self.stops.done_in_flight(r, r.in_flight)]
        if not rows:
            return False
        held = len(ready) - len(rows)  # counted once a step, on its first round (the trace reads it)
        widths = self.backend.verify_widths(len(rows)) if self.plan.num_speculative_tokens > 0 else ()
        drafted, constrained = _drafted(rows), any(r.grammar is not None for r in rows)
        planned, self._planned = self._planned, None
        width = planned if constrained and planned in (1, *widths) else self.policy.choose(len(rows), widths, drafted)
        if constrained:  # the round launches its successor's unmasked part: choose that one's width now
            self._planned = self.policy.choose(len(rows), widths, drafted)
        for group, w in (([r for r in rows if width > 1 and r.speculate], width),
                         ([r for r in rows if not (width > 1 and r.speculate)], 1)):
            if group:
                launched = time.perf_counter()  # before the launch: a synchronous backend runs the round in it
                then = self._planned if w == width else 1  # rows that never draft run plain next too
                self.flights.append(Flight(self.backend.launch(group, w, then), tuple(group), launched,
                                           step=self.steps, held=held))
                held = 0
                for req in group:
                    self.clock.ahead += req.in_flight > 0
                    req.in_flight += 1
                    if req.phase is Phase.DRAFT:
                        advance(req, Phase.VERIFY)
        return True

    def _collect(self, flight: Flight) -> None:
        waited = time.perf_counter()
        result = self.backend.collect(flight.handle)
        now = time.perf_counter()
        self.clock.wait_s += now - waited
        # the flight's share of wall time: from its launch, or from the previous collect when it ran behind that
        # one; a constrained round's from the previous collect always, as its launch waited for that booking
        synchronous = not flight.prefill and self._last_collect is not None and flight.constrained
        wall = now - (self._last_collect if synchronous else max(flight.launched, self._last_collect or 0.0))
        self._last_collect = now
        if flight.prefill:
            self._first_tokens(flight, result)
            # untimed, a synchronous backend's prefill ran inside its launch
            self.scheduler.pacer.prefilled(flight.tokens, wall + flight.launch_s if result.device_s is None
                                           else result.device_s)
            if self.trace is not None:
                self.trace.append({"t": now, "prefill": True, "rows": len(flight.reqs), "wall_s": wall,
                                   "launch_s": flight.launch_s, "device_s": result.device_s,
                                   "prefilled": list(flight.ends), "launched": flight.launched,
                                   "device_at": result.device_at})
            return
        self.clock.rounds += 1
        self.scheduler.pacer.rounded(wall if result.device_s is None else result.device_s)
        # the width the round ran: a backend may widen it (rows that read logits take its full window)
        width = 1 + max(map(len, result.drafted), default=0)
        expected = {kind: self.policy.expected(width, kind) for kind in (False, True)}  # greedy rows', sampled rows'
        emitted, accepted, sampled = 0, [], []
        for i, req in enumerate(flight.reqs):
            req.in_flight -= 1
            if req.phase is Phase.FINISHED:  # stopped by an earlier round, cancelled or failed
                continue
            if not result.finite[i]:  # one request's failure ends that request, never the batch
                abort(req, "non-finite logits in verify")
                continue
            accepted.append(result.accepted[i])
            sampled.append(req.params.temperature > 0)
            req.stats.expected_accepted += expected[sampled[-1]]
            emitted += self._book(req, result.drafted[i], result.accepted[i], result.tokens[i])
        if accepted:  # a round only stopped requests ran says nothing of its choice
            # the wall share also reads whatever held a shared host back, so where the backend times
            # the round on the device, the policy weighs that and the host's cycle instead
            # a constrained round's device span starts wherever its part ahead did: its wall share is what it cost
            timed = result.device_s is not None and not synchronous
            self.policy.record(len(flight.reqs), width, result.device_s if timed else wall, emitted, accepted,
                               self._host_s if timed else None, sampled)
            if self.trace is not None:
                self.trace.append({"t": now, "prefill": False, "rows": len(flight.reqs), "width": width,
                                   "held": flight.held, "emitted": emitted, "wall_s": wall, "device_s": result.device_s,
                                   "host_s": self._host_s, "launched": flight.launched,
                                   "device_at": result.device_at})

    def _book(self, req: Request, drafted: list[int], accepted: int, tokens: list[int]) -> int:
        start = req.seq_len
        advance(req, Phase.ACCEPT)
        req.stats.record(accepted, len(drafted))
        if req.grammar is not None:  # each token was allowed by its slot's mask
            req.grammar.advance(tokens)
        kept = self.stops.apply(req, tokens)
        if req.rounds is not None:
            req.rounds.append(Round(position=start, drafted=tuple(drafted), accepted=accepted, emitted=tuple(kept)))
        if req.finish_reason:
            advance(req, Phase.FINISHED)
        else:
            advance(req, Phase.DRAFT)
            if req.in_flight:  # the next round already runs
                advance(req, Phase.VERIFY)
        return len(kept)

    def abort_all(self, message: str) -> None:
        """End every admitted request (after a step raised): rounds in flight are forgotten."""
        for flight in self.flights:
            for req in flight.reqs:
                req.in_flight -= 1
        self.flights.clear()
        for req in self.scheduler.running:
            abort(req, message)
        self.scheduler.reap(self.free)

    def free(self, req: Request) -> None:
        """A finished request's rounds still in flight write only its own slot, in stream order
        before whatever reuses it; their results are ignored when collected."""
        self.backend.free(req)


def _drafted(rows: list[Request]) -> Drafted:
    """The drafts the rows accepted so far, what the policy's acceptance model expected, and
    how many of the rows sample."""
    return Drafted(sum(r.stats.accepted_tokens for r in rows), sum(r.stats.expected_accepted for r in rows),
                   len(rows), sum(r.params.temperature > 0 for r in rows))
