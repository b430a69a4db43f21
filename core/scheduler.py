"""Admits waiting requests into free batch slots and retires finished ones, between steps."""

from __future__ import annotations

from collections import deque
from typing import Callable

from .blocks import BlockPool
from .machine import Phase, abort
from .pacer import Pacer
from .prefix import PrefixCache, block_keys
from .request import Request


class Scheduler:
    def __init__(self, max_batch_size: int, max_prefill_tokens: int | None = None, chunked: bool = False,
                 pool: BlockPool | None = None, admission_wait: int = 0, prefix: PrefixCache | None = None,
                 pacer: Pacer | None = None):
        self.max_batch_size = max_batch_size
        self.pacer = pacer or Pacer(None)  # bounds a step's prefill while others decode, from the machine's timings
        # the backend's prefix cache (read only): a prompt that starts with blocks another is
        # computing waits for them to be cached instead of computing them again beside it
        self.prefix = prefix
        self._keys: dict[int, tuple[int, list[int]]] = {}  # rid -> (prefill_len, its blocks' keys)
        self.admission_wait = admission_wait  # steps an admission may wait for others to go with it
        self.steps = 0  # schedule() calls
        self.ready_since: int | None = None  # the step from which a waiting request could take a free slot
        self.pool = pool  # KV blocks: admission while they last, preemption when rounds need more (None: slots only)
        self.max_prefill_tokens = max_prefill_tokens  # a step's prefilled prompt tokens (None: no bound)
        self.chunked = chunked  # the backend prefills a prompt in chunks over several steps
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.cancelled: list[Request] = []  # finished while waiting; handed back by reap

    def add(self, req: Request) -> None:
        req.phase = Phase.WAITING
        self.waiting.append(req)

    def queued(self) -> int:
        """Requests waiting for their first admission (a preempted one was accepted already)."""
        return sum(1 for r in self.waiting if not r.preemptions)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.cancelled)

    def schedule(self) -> tuple[list[tuple[Request, int]], list[Request]]:
        """((request, prompt position its prefill runs to this step) for each prefill, the
        requests already running); cancellations end their requests here, before anything
        runs. Within max_prefill_tokens a step (while others decode, within the pacer's
        budget): first the chunks of prompts being prefilled, then new requests in arrival
        order while slots last; with a chunking backend the last one admitted may take only
        part of its prompt (not one asking prompt logprobs), else whole prompts, the first
        one always; and while the KV pool has the blocks of the whole prompt (a resumed
        request's: prompt and generated tokens). With admission_wait, new requests wait
        while others run so they are prefilled together (_admitting). A prompt that starts
        with blocks another prefill computes now waits, and the requests behind it go first
        (_waits_for)."""
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            abort(req, req.cancel_reason)
            self.cancelled.append(req)
            self._keys.pop(req.rid, None)
        for req in self.running:
            if req.cancelled:
                abort(req, req.cancel_reason)
        running = [r for r in self.running if r.phase is not Phase.FINISHED]
        budget = self.max_prefill_tokens if self.max_prefill_tokens is not None else float("inf")
        # streams that a prefill would hold back (no scan of the rows a step where nothing bounds it)
        if self.pacer.stall is not None and any(r.phase is not Phase.PREFILL for r in running):
            budget = self.pacer.budget(budget)
        prefills = []
        for req in running:  # prompts part-way through their prefill
            if req.prefilled < req.prefill_len and req.phase is Phase.PREFILL and budget > 0:
                end = min(req.prefill_len, req.prefilled + budget)
                prefills.append((req, end))
                budget -= end - req.prefilled
        self.steps += 1
        admitting = self._admitting(running)
        held = self._held()
        flying = {k for r in running if r.phase is Phase.PREFILL for k in self._blocks(r)}
        for req in list(self.waiting) if admitting else ():
            if len(self.running) >= self.max_batch_size or budget <= 0 or not self._fits(req, held):
                break
            if self._waits_for(req, flying):
                continue  # its prefix is being computed: the cache gives it once that is done
            need, chunkable = req.prefill_len, self._chunks(req)
            if need > budget and not chunkable and prefills:
                break  # a whole prompt that does not fit: the next step takes it
            self.waiting.remove(req)
            end = need if need <= budget or not chunkable else int(budget)
            prefills.append((req, end))
            budget -= end
            self.running.append(req)
            held += 0 if self.pool is None else self.pool.demand(req)
            flying.update(self._blocks(req))
        return prefills, running

    def _blocks(self, req: Request) -> list[int]:
        """The prefix cache's keys of the full blocks ``req``'s prefill may cache or find (none
        without a cache, or for a prompt asking prompt logprobs, which never meets it)."""
        if self.prefix is None or req.params.prompt_logprobs is not None:
            return []
        known = self._keys.get(req.rid)
        if known is None or known[0] != req.prefill_len:
            keys = block_keys(req.prefill_ids, self.prefix.block_size, req.prefill_len - 1)
            known = self._keys[req.rid] = (req.prefill_len, keys)
        return known[1]

    def _waits_for(self, req: Request, flying: set[int]) -> bool:
        """Whether at least half of ``req``'s full blocks are ones another prefill computes now,
        in the run it starts with (cached blocks in that run it finds anyway): waiting for them
        to be cached costs less than computing them twice."""
        keys, gain = self._blocks(req), 0
        for key in keys:
            if key in self.prefix.blocks:
                continue
            if key not in flying:
                break
            gain += 1
        return gain > 0 and 2 * gain >= len(keys)

    def _admitting(self, running: list[Request]) -> bool:
        """Whether new requests are admitted this step (server.admission_wait): at once when it
        is 0 or nothing runs; else once one could take a free slot, when admission_wait steps
        have passed since, or when a quarter of max_batch_size could go together."""
        could = min(len(self.waiting), self.max_batch_size - len(self.running))
        if could <= 0:
            self.ready_since = None
            return False
        if self.admission_wait == 0 or not running:
            self.ready_since = None
            return True
        if self.ready_since is None:
            self.ready_since = self.steps
        if self.steps - self.ready_since >= self.admission_wait or could >= max(1, self.max_batch_size // 4):
            self.ready_since = None
            return True
        return False

    def _held(self) -> int:
        """Blocks the live running requests hold (0 without a pool). Those ended or cancelled
        are not counted: the machine frees them before this step launches anything."""
        return 0 if self.pool is None else sum(map(self.pool.demand, self._live()))

    def _fits(self, req: Request, held: int) -> bool:
        """Whether the pool has the request's blocks beside the ``held`` ones (alone, it always
        fits: a request that could not was refused when it came; every live request holds a
        block, so 0 held is none live). ``held`` is counted once a step and grows by each
        admission, not summed again over every running request."""
        return self.pool is None or held == 0 or held + self.pool.demand(req) <= self.pool.total

    def victims(self) -> list[Request]:
        """The running requests to preempt so the others' next rounds get their blocks."""
        return [] if self.pool is None else self.pool.victims(self._live())

    def _live(self) -> list[Request]:
        """The running requests that hold blocks on: not ended, nor cancelled (ended this step)."""
        return [r for r in self.running if r.phase is not Phase.FINISHED and not r.cancelled]

    def requeue(self, req: Request) -> None:
        """A preempted request: out of the running, first in line again."""
        self.running.remove(req)
        self.waiting.appendleft(req)

    def _chunks(self, req: Request) -> bool:
        return self.chunked and req.params.prompt_logprobs is None

    def reap(self, free: Callable[[Request], None]) -> list[Request]:
        done = [r for r in self.running if r.phase is Phase.FINISHED]
        for req in done:
            free(req)
            self._keys.pop(req.rid, None)
        self.running = [r for r in self.running if r.phase is not Phase.FINISHED]
        done, self.cancelled = done + self.cancelled, []
        return done
