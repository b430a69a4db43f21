"""Admits waiting requests into free batch slots and retires finished ones, between steps."""

from __future__ import annotations

from collections import deque
from typing import Callable

from .machine import Phase, abort
from .request import Request


class Scheduler:
    def __init__(self, max_batch_size: int, max_prefill_tokens: int | None = None):
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens  # a step's admitted prompt tokens (None: no bound)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.cancelled: list[Request] = []  # finished while waiting; handed back by reap

    def add(self, req: Request) -> None:
        req.phase = Phase.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.cancelled)

    def schedule(self) -> tuple[list[Request], list[Request]]:
        """(requests to prefill now, requests already running); cancellations end their
        requests here, before anything runs. Admits in arrival order while slots last and the
        step's prompt tokens stay within max_prefill_tokens (the first admitted always goes)."""
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            abort(req, "cancelled")
            self.cancelled.append(req)
        for req in self.running:
            if req.cancelled:
                abort(req, "cancelled")
        running = [r for r in self.running if r.phase is not Phase.FINISHED]
        admitted, tokens = [], 0
        while self.waiting and len(self.running) + len(admitted) < self.max_batch_size:
            tokens += len(self.waiting[0].prompt_ids)
            if admitted and self.max_prefill_tokens is not None and tokens > self.max_prefill_tokens:
                break
            admitted.append(self.waiting.popleft())
        self.running.extend(admitted)
        return admitted, running

    def reap(self, free: Callable[[Request], None]) -> list[Request]:
        done = [r for r in self.running if r.phase is Phase.FINISHED]
        for req in done:
            free(req)
        self.running = [r for r in self.running if r.phase is not Phase.FINISHED]
        done, self.cancelled = done + self.cancelled, []
        return done
