"""Admits waiting requests into free batch slots and retires finished ones, between steps."""

from __future__ import annotations

from collections import deque
from typing import Callable

from .machine import Phase, abort
from .request import Request


class Scheduler:
    def __init__(self, max_batch_size: int, max_prefill_tokens: int | None = None, chunked: bool = False):
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens  # a step's prefilled prompt tokens (None: no bound)
        self.chunked = chunked  # the backend prefills a prompt in chunks over several steps
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.cancelled: list[Request] = []  # finished while waiting; handed back by reap

    def add(self, req: Request) -> None:
        req.phase = Phase.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.cancelled)

    def schedule(self) -> tuple[list[tuple[Request, int]], list[Request]]:
        """((request, prompt position its prefill runs to this step) for each prefill, the
        requests already running); cancellations end their requests here, before anything
        runs. Within max_prefill_tokens a step: first the chunks of prompts being prefilled,
        then new requests in arrival order while slots last; with a chunking backend the last
        one admitted may take only part of its prompt (not one asking prompt logprobs), else
        whole prompts, the first one always."""
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            abort(req, "cancelled")
            self.cancelled.append(req)
        for req in self.running:
            if req.cancelled:
                abort(req, "cancelled")
        running = [r for r in self.running if r.phase is not Phase.FINISHED]
        budget = self.max_prefill_tokens if self.max_prefill_tokens is not None else float("inf")
        prefills = []
        for req in running:  # prompts part-way through their prefill
            if req.prefilled < len(req.prompt_ids) and req.phase is Phase.PREFILL and budget > 0:
                end = min(len(req.prompt_ids), req.prefilled + budget)
                prefills.append((req, end))
                budget -= end - req.prefilled
        while self.waiting and len(self.running) < self.max_batch_size and budget > 0:
            req = self.waiting[0]
            need, chunkable = len(req.prompt_ids), self._chunks(req)
            if need > budget and not chunkable and prefills:
                break  # a whole prompt that does not fit: the next step takes it
            self.waiting.popleft()
            end = need if need <= budget or not chunkable else int(budget)
            prefills.append((req, end))
            budget -= end
            self.running.append(req)
        return prefills, running

    def _chunks(self, req: Request) -> bool:
        return self.chunked and req.params.prompt_logprobs is None

    def reap(self, free: Callable[[Request], None]) -> list[Request]:
        done = [r for r in self.running if r.phase is Phase.FINISHED]
        for req in done:
            free(req)
        self.running = [r for r in self.running if r.phase is not Phase.FINISHED]
        done, self.cancelled = done + self.cancelled, []
        return done
