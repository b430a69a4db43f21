"""Starting the HTTP server: blocking for `draftline serve`, in a thread for tests and benches."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import uvicorn

from draftline.core.engine import Engine
from draftline.core.loop import EngineLoop
from draftline.core.spec import Spec

from .app import create_app


def build(spec: Spec, engine: Engine | None = None) -> tuple[EngineLoop, object]:
    loop = EngineLoop(engine or Engine(spec), spec.server.max_queue)
    app = create_app(loop)
    return loop.start(), app  # started last: what start-up made, the app's routes too, is frozen (core/collector.py)


def serve(spec: Spec, host: str, port: int) -> None:
    loop, app = build(spec)
    try:
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:
        loop.stop()


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
