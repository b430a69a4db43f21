"""The FastAPI app: a thin layer from request models to the engine loop."""

from __future__ import annotations

import json
import os
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from draftline.core.engine import RequestError
from draftline.core.loop import EngineDead, EngineLoop, QueueFull
from draftline.core.machine import describe_transitions

from .chat import ChatRoute
from .completions import CompletionsRoute
from .metrics import Metrics
from .native import GenerateRoute
from .schemas import ChatRequest, CompletionRequest, GenerateRequest


def _error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status, headers=headers)


def model_name(loop: EngineLoop) -> str:
    m = loop.engine.spec.model
    return m.path.name if m.path is not None else f"random-{m.random_init.preset}"


def create_app(loop: EngineLoop) -> FastAPI:
    app = FastAPI(title="draftline", version="0.1.0")
    metrics = Metrics()
    loop.finish_listeners.append(metrics.finished)
    spec = loop.engine.spec
    token = os.environ.get(spec.server.api_key_env) if spec.server.api_key_env else None

    def authorize(request: Request) -> None:
        if token is not None and request.headers.get("authorization") != f"Bearer {token}":
            raise PermissionError("missing or wrong bearer token (Authorization: Bearer <token>)")

    _error_handlers(app, metrics)
    _status_routes(app, loop, metrics, Depends(authorize))
    _generation_routes(app, loop, Depends(authorize))
    return app


def _error_handlers(app: FastAPI, metrics: Metrics) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.rejected.labels(reason="invalid").inc()
        parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        return JSONResponse({"error": {"message": "; ".join(parts), "type": "invalid_request_error", "code": 422},
                             "detail": json.loads(json.dumps(exc.errors(), default=str))}, 422)

    @app.exception_handler(RequestError)
    async def bad_request(_: Request, exc: RequestError) -> JSONResponse:
        metrics.rejected.labels(reason="invalid").inc()
        return _error(400, str(exc), "invalid_request_error")

    @app.exception_handler(QueueFull)
    async def full(_: Request, exc: QueueFull) -> JSONResponse:
        metrics.rejected.labels(reason="queue_full").inc()
        return _error(503, str(exc), "overloaded", {"Retry-After": "1"})

    @app.exception_handler(EngineDead)
    async def dead(_: Request, exc: EngineDead) -> JSONResponse:
        return _error(503, str(exc), "unavailable")

    @app.exception_handler(PermissionError)
    async def denied(_: Request, exc: PermissionError) -> JSONResponse:
        return _error(401, str(exc), "unauthorized", {"WWW-Authenticate": "Bearer"})


def _status_routes(app: FastAPI, loop: EngineLoop, metrics: Metrics, auth: Any) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        status = loop.status()
        return JSONResponse({"status": "ok" if status["ready"] else "unavailable", **status}, 200 if status["ready"] else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[auth])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name(loop), "object": "model", "owned_by": "draftline"}]}

    @app.get("/spec", dependencies=[auth])
    async def active_spec() -> dict[str, Any]:
        plan, prefix = loop.engine.plan, getattr(loop.engine.backend, "prefix", None)
        return {"spec": loop.engine.spec.model_dump(mode="json"), "plan": plan.__dict__ | {"target_layer_ids": list(plan.target_layer_ids)},
                "phases": describe_transitions(), "draft_policy": loop.engine.policy.table(),
                "prefix_cache": None if prefix is None else prefix.summary(),  # None: the backend caches no prefix
                "kv_blocks": loop.engine.blocks.__dict__ | {"preemptions": loop.engine.machine.clock.preemptions}}


def _generation_routes(app: FastAPI, loop: EngineLoop, auth: Any) -> None:
    @app.post("/generate", dependencies=[auth])
    async def generate(body: GenerateRequest):
        route = GenerateRoute(loop, body)
        return route.stream() if body.stream else await route.respond()

    @app.post("/v1/completions", dependencies=[auth])
    async def completions(body: CompletionRequest):
        route = CompletionsRoute(loop, body, model_name(loop))
        return route.stream() if body.stream else await route.respond()

    @app.post("/v1/chat/completions", dependencies=[auth])
    async def chat(body: ChatRequest):
        route = ChatRoute(loop, body, model_name(loop))
        return route.stream() if body.stream else await route.respond()
