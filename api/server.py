"""Starting the HTTP server: blocking for `draftline serve`, in a thread for tests and benches.

`draftline serve` shuts down on SIGTERM or SIGINT: the listening socket closes, new requests
on open connections get a 503, waiting requests are aborted, running ones have
``server.shutdown_timeout_s`` to finish (then are aborted, their clients told why), and the
process exits 0. A second signal exits at once (128 + the signal's number)."""

from __future__ import annotations

import os
import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import structlog
import uvicorn

from draftline.core.engine import Engine
from draftline.core.loop import EngineLoop
from draftline.core.spec import Spec

from .app import create_app
from .gate import api_token

log = structlog.get_logger("draftline.server")
FLUSH_S = 5.0  # after the shutdown timeout, for the aborted requests' last answers to go out


def build(spec: Spec, engine: Engine | None = None) -> tuple[EngineLoop, object]:
    api_token(spec)  # a missing token refuses to start before the engine loads
    loop = EngineLoop(engine or Engine(spec), spec.server.max_queue)
    app = create_app(loop)
    return loop.start(), app  # started last: what start-up made, the app's routes too, is frozen (core/collector.py)


class _Server(uvicorn.Server):
    """uvicorn's server with draftline's shutdown: the first signal winds the engine loop down
    (uvicorn stops accepting and waits for the open responses), a second one exits at once.
    uvicorn would re-raise the signal after a graceful stop; a clean stop exits 0 instead."""

    def __init__(self, config: uvicorn.Config, loop: EngineLoop, timeout_s: float):
        super().__init__(config)
        self.engine_loop, self.timeout_s = loop, timeout_s

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:
            os._exit(128 + sig)
        self.should_exit = True
        self.engine_loop.close(self.timeout_s)
        log.info("server.shutting_down", signal=sig, timeout_s=self.timeout_s)


def serve(spec: Spec, host: str, port: int) -> int:
    loop, app = build(spec)
    timeout = spec.server.shutdown_timeout_s
    config = uvicorn.Config(app, host=host, port=port, log_level="info",
                            timeout_graceful_shutdown=int(timeout + FLUSH_S))
    try:
        _Server(config, loop, timeout).run()
    finally:
        loop.stop()
    return 0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextmanager
def background(spec: Spec, engine: Engine | None = None, host: str = "127.0.0.1") -> Iterator[str]:
    """A real uvicorn server on a free loopback port for the duration; yields its base URL."""
    loop, app = build(spec, engine)
    port = free_port(host)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        loop.stop()
