"""The FastAPI app: a thin layer from request models to the engine loop. Behind one gate
(api/gate.py: the bearer token, the body's size), every error in OpenAI's shape (api/errors.py),
each request's sizes checked before any work (api/limits.py)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from draftline.core.loop import EngineLoop
from draftline.core.machine import describe_transitions

from . import errors
from .catalog import Catalog
from .chat import ChatRoute
from .completions import CompletionsRoute
from .gate import Gate, api_token
from .limits import Limits
from .metrics import Metrics
from .native import GenerateRoute
from .schemas import ChatRequest, CompletionRequest, GenerateRequest


def create_app(loop: EngineLoop) -> FastAPI:
    """The app; ConfigError if the spec asks for a token whose variable is unset or empty."""
    spec = loop.engine.spec
    token = api_token(spec)
    app = FastAPI(title="draftline", version="0.1.0")
    metrics = Metrics()
    loop.finish_listeners.append(metrics.finished)
    catalog, limits = Catalog(spec), Limits.of(spec)
    errors.install(app, metrics)
    _status_routes(app, loop, metrics, catalog)
    _generation_routes(app, loop, catalog, limits)
    app.add_middleware(Gate, token=token, max_bytes=spec.server.max_request_bytes)
    return app


def _status_routes(app: FastAPI, loop: EngineLoop, metrics: Metrics, catalog: Catalog) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        status = loop.status()
        return JSONResponse({"status": "ok" if status["ready"] else "unavailable", **status}, 200 if status["ready"] else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": catalog.entries()}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        return catalog.entry(model_id)

    @app.get("/spec")
    async def active_spec() -> dict[str, Any]:
        plan, prefix = loop.engine.plan, getattr(loop.engine.backend, "prefix", None)
        return {"spec": loop.engine.spec.model_dump(mode="json"), "plan": plan.__dict__ | {"target_layer_ids": list(plan.target_layer_ids)},
                "phases": describe_transitions(), "draft_policy": loop.engine.policy.table(),
                "prefix_cache": None if prefix is None else prefix.summary(),  # None: the backend caches no prefix
                "kv_blocks": loop.engine.blocks.__dict__ | {"preemptions": loop.engine.machine.clock.preemptions}}


def _generation_routes(app: FastAPI, loop: EngineLoop, catalog: Catalog, limits: Limits) -> None:
    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        route = GenerateRoute(loop, body, limits)
        return await route.stream() if body.stream else await route.respond(request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        catalog.check(body.model)
        route = CompletionsRoute(loop, body, catalog.name, limits)
        return await route.stream() if body.stream else await route.respond(request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        catalog.check(body.model)
        route = ChatRoute(loop, body, catalog.name, limits)
        return await route.stream() if body.stream else await route.respond(request)
