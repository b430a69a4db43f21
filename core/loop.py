"""The engine loop: one thread steps the engine; asyncio callers submit requests and read
their progress. A failing step ends the requests it was running, never the loop."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import structlog
import torch

from .collector import Collector
from .engine import Completion, Engine
from .detokenizer import TextStream
from .request import Request
from .sampling import SamplingParams

log = structlog.get_logger("draftline.server")


def stable_text(text: str, stops: tuple[str, ...]) -> str:
    """What can be streamed now: hold back a trailing incomplete UTF-8 character and any
    suffix that may still grow into a stop string (which the final text excludes)."""
    text = text.rstrip("\ufffd")
    hold = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    return text[: len(text) - hold]


class QueueFull(RuntimeError):
    """The server's waiting queue is at its bound (server.max_queue); retry later."""


class EngineDead(RuntimeError):
    """The loop thread has stopped; the server reports unhealthy."""


@dataclass(frozen=True)
class Update:
    """A request's progress after a step: cumulative output, and the final result when done."""

    text: str
    output_ids: list[int]
    finished: Completion | None = None


@dataclass
class Handle:
    """The caller's side of one request."""

    aio: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    req: Request | None = None
    sent_ids: int = 0
    stream: TextStream | None = None  # the output's text, decoded as it grows

    def cancel(self) -> None:
        if self.req is not None:
            self.req.cancelled = True  # the loop frees the slot at its next step

    async def updates(self):
        """Each update as it comes; a reader that fell behind gets the newest of those waiting
        (updates are cumulative, so it says everything the older ones did)."""
        while True:
            update: Update = await self.queue.get()
            while update.finished is None and not self.queue.empty():
                update = self.queue.get_nowait()
            yield update
            if update.finished is not None:
                return

    async def result(self) -> Completion:
        async for update in self.updates():
            if update.finished is not None:
                return update.finished
        raise RuntimeError("request ended without a result")


def _deliver(batch: list[tuple[Handle, Update]]) -> None:
    for handle, update in batch:
        handle.queue.put_nowait(update)


class EngineLoop:
    def __init__(self, engine: Engine, max_queue: int):
        self.engine, self.max_queue = engine, max_queue
        self.inbox: list[Handle] = []  # submitted, not yet handed to the scheduler
        self.active: list[Handle] = []
        self.cond = threading.Condition()
        self.finish_listeners: list[Callable[[Request, Completion], None]] = []
        self.thread = threading.Thread(target=self._run, name="draftline-engine", daemon=True)
        self.ready = self.dead = self.stopping = False
        self.consecutive_failures = 0
        self.collector = Collector()

    def start(self) -> "EngineLoop":
        frozen = self.collector.start()  # start-up's objects out of every full collection's walk
        log.info("gc.frozen", objects=frozen)
        self.thread.start()
        return self

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout=10)
        self.collector.stop()

    def submit(self, prompt: str | Sequence[int], params: SamplingParams, speculate: bool = True,
               stop: Sequence[str] = ()) -> Handle:
        """Validate and queue a request; RequestError, QueueFull or EngineDead are raised here."""
        handle = Handle(aio=asyncio.get_running_loop(), stream=self.engine.text_stream())
        with self.cond:
            if self.dead:
                raise EngineDead("the engine loop has stopped; see the server log")
            if len(self.inbox) + self.engine.scheduler.queued() >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests already waiting (server.max_queue); retry shortly")
            handle.req = self.engine.make_request(prompt, params, speculate=speculate, stop=stop)
            self.inbox.append(handle)
            self.cond.notify()
        return handle

    def _run(self) -> None:
        if self.engine.device.type == "cpu":
            # Leave a core to the HTTP side: torch's worker threads spin-wait, and contending
            # with the event loop for every core made each step several times slower.
            torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
        self.ready = True
        log.info("engine.ready", method=self.engine.plan.method, backend=self.engine.backend_name,
                 torch_threads=torch.get_num_threads())
        try:
            while not self.stopping:
                self._admit()
                if self.engine.scheduler.has_work():
                    self._step()
        except BaseException as exc:  # the loop itself broke: report dead, answer everyone left
            with self.cond:
                self.dead = True
                pending, self.inbox = self.inbox, []
            log.exception("engine.dead", error=repr(exc))
            self.active += pending
            for handle in list(self.active):
                handle.req.finish({"type": "abort", "message": f"engine stopped: {exc!r}"})
            self._publish_all()

    def _admit(self) -> None:
        with self.cond:
            while not self.inbox and not self.engine.scheduler.has_work() and not self.stopping:
                self.cond.wait(timeout=0.5)
            pending, self.inbox = self.inbox, []
        for handle in pending:
            self.engine.scheduler.add(handle.req)
            self.active.append(handle)

    def _step(self) -> None:
        try:
            self.engine.step()
            self.consecutive_failures = 0
        except Exception as exc:  # a step that raised ends the requests it held, not the loop
            self.consecutive_failures += 1
            log.exception("engine.step_failed", error=repr(exc), running=len(self.engine.scheduler.running))
            self.engine.abort_running(f"internal error: {exc!r}")
            if self.consecutive_failures >= 8:
                raise
        self._publish_all()

    def _publish_all(self) -> None:
        """Every active request's progress since its last update, handed to each event loop in
        one call: a wake-up per step, not per request."""
        outbox: dict[asyncio.AbstractEventLoop, list[tuple[Handle, Update]]] = {}
        try:
            for handle in list(self.active):
                self._publish(handle, outbox)
        finally:  # what was made goes out even if a finish listener raised
            for aio, batch in outbox.items():
                aio.call_soon_threadsafe(_deliver, batch)

    def _publish(self, handle: Handle, outbox: dict) -> None:
        req = handle.req
        done = req.finish_reason is not None
        if not done and len(req.output_ids) == handle.sent_ids:
            return
        handle.sent_ids = len(req.output_ids)
        finished = self.engine.completion(req) if done else None
        text = finished.text if done else stable_text(handle.stream.update(req.output_ids), req.stop_strings)
        outbox.setdefault(handle.aio, []).append((handle, Update(text, list(req.output_ids), finished)))
        if done:  # metrics and logs before the client's event loop runs: it then sees its answer counted
            self.active.remove(handle)
            self._log_finished(req, finished)

    def _log_finished(self, req: Request, c: Completion) -> None:
        m = c.meta_info
        ttft = (req.t_first_token - req.t_arrival) if req.t_first_token else None
        log.info("request.finished", id=m["id"], prompt_tokens=m["prompt_tokens"], completion_tokens=m["completion_tokens"],
                 tau=m["spec_accept_length"], ttft_s=None if ttft is None else round(ttft, 4),
                 total_s=m["e2e_latency"], finish_reason=m["finish_reason"])
        for listener in self.finish_listeners:
            listener(req, c)

    def status(self) -> dict[str, Any]:
        return {"ready": self.ready and not self.dead, "running": len(self.engine.scheduler.running),
                "waiting": len(self.engine.scheduler.waiting) + len(self.inbox), "time": time.time(),
                "gc": self.collector.summary()}
