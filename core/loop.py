"""The engine loop: one thread steps the engine; asyncio callers submit requests and read
their progress. A failing step ends the requests it was running, never the loop.

A request is prepared (tokenized and checked) by its caller, off the event loop and outside
the loop's lock, and only then queued under the lock: a long prompt holds up neither the
other clients nor the engine. ``close`` winds the loop down for a shutdown."""

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
from .detokenizer import TextStream
from .engine import Completion, Engine
from .holdback import Holdback
from .request import Request
from .sampling import SamplingParams

log = structlog.get_logger("draftline.server")
QUEUED_AT_SHUTDOWN = "server shutting down: the request had not started; send it to a running server"


class QueueFull(RuntimeError):
    """The server's waiting queue is at its bound (server.max_queue); retry later."""


class EngineDead(RuntimeError):
    """The loop thread has stopped; the server reports unhealthy."""


class ShuttingDown(RuntimeError):
    """The server is shutting down and takes no new request."""


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
    holdback: Holdback | None = None  # what of that text its stop strings hold back

    def cancel(self, reason: str = "cancelled") -> None:
        if self.req is not None:
            self.req.cancel(reason)  # the loop frees the slot at its next step

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
        self.closing: float | None = None  # set by close(): when running requests are aborted
        self.closing_after = 0.0  # close()'s timeout, for the abort message
        self.queued = 0  # requests waiting in the scheduler, as of the engine thread's last look
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

    def close(self, timeout_s: float) -> None:
        """Wind down for a shutdown: no new requests, the waiting ones aborted, the running
        ones given ``timeout_s`` to finish, then aborted. Safe from a signal handler (plain
        assignments; a thread wakes the loop)."""
        self.closing_after = timeout_s
        self.closing = time.monotonic() + timeout_s
        threading.Thread(target=self._wake, name="draftline-close", daemon=True).start()

    def _wake(self) -> None:
        with self.cond:
            self.cond.notify()

    def prepare(self, prompt: str | Sequence[int], params: SamplingParams, speculate: bool = True,
                stop: Sequence[str] = ()) -> Request:
        """Tokenize and check a request (RequestError names what is wrong). Callers run it in a
        worker thread: it takes neither the event loop nor the loop's lock."""
        return self.engine.make_request(prompt, params, speculate=speculate, stop=stop)

    def enqueue(self, reqs: Sequence[Request]) -> list[Handle]:
        """Queue prepared requests, all or none: QueueFull, EngineDead or ShuttingDown otherwise."""
        aio = asyncio.get_running_loop()
        handles = [Handle(aio=aio, req=r, stream=self.engine.text_stream(), holdback=Holdback(r.stop_strings))
                   for r in reqs]
        with self.cond:
            if self.dead:
                raise EngineDead("the engine loop has stopped; see the server log")
            if self.closing is not None:
                raise ShuttingDown("the server is shutting down and takes no new requests; send it to a running server")
            waiting = len(self.inbox) + self.queued
            if waiting + len(handles) > self.max_queue:
                raise QueueFull(f"{waiting} requests already waiting and server.max_queue is {self.max_queue}; "
                                "retry shortly")
            self.inbox += handles
            self.cond.notify()
        return handles

    def submit(self, prompt: str | Sequence[int], params: SamplingParams, speculate: bool = True,
               stop: Sequence[str] = ()) -> Handle:
        """prepare() and enqueue() one request, in the caller's thread (for callers without an
        event loop of their own to keep free)."""
        return self.enqueue([self.prepare(prompt, params, speculate, stop)])[0]

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
                if self.closing is not None:
                    self._wind_down()
                if self.engine.scheduler.has_work():
                    self._step()
                self.queued = self.engine.scheduler.queued()
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
            self.queued += len(pending)  # counted as waiting from here (enqueue reads it under the lock)
        for handle in pending:
            self.engine.scheduler.add(handle.req)
            self.active.append(handle)

    def _wind_down(self) -> None:
        """Closing: each waiting request is aborted, and each running one once the time is up."""
        for req in self.engine.scheduler.waiting:
            if not req.cancelled:
                req.cancel(QUEUED_AT_SHUTDOWN)
        if time.monotonic() >= self.closing:
            for req in self.engine.scheduler.running:
                if not req.cancelled:
                    req.cancel(f"server shutting down: not finished within server.shutdown_timeout_s "
                               f"({self.closing_after:g} s)")

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
        text = finished.text if done else handle.holdback.stable(handle.stream.update(req.output_ids))
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
        return {"ready": self.ready and not self.dead and self.closing is None,
                "shutting_down": self.closing is not None, "running": len(self.engine.scheduler.running),
                "waiting": len(self.engine.scheduler.waiting) + len(self.inbox), "time": time.time(),
                "gc": self.collector.summary()}
