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
    # routes reach the engine through the app, never a closure: FastAPI keeps each route's
    # endpoint in a process-wide cache, which would keep a stopped server's engine (its GPU
    # memory) alive for good
    app.state.loop = loop
    _status_routes(app, metrics, catalog)
    _generation_routes(app, catalog, limits)
    app.add_middleware(Gate, token=token, max_bytes=spec.server.max_request_bytes)
    return app


def _loop(request: Request) -> EngineLoop:
    return request.app.state.loop


def _status_routes(app: FastAPI, metrics: Metrics, catalog: Catalog) -> None:
    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        status = _loop(request).status()
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
    async def active_spec(request: Request) -> dict[str, Any]:
        engine = _loop(request).engine
        plan, prefix = engine.plan, getattr(engine.backend, "prefix", None)
        return {"spec": engine.spec.model_dump(mode="json"), "plan": plan.__dict__ | {"target_layer_ids": list(plan.target_layer_ids)},
                "phases": describe_transitions(), "draft_policy": engine.policy.table(),
                "prefix_cache": None if prefix is None else prefix.summary(),  # None: the backend caches no prefix
                "kv_blocks": engine.blocks.__dict__ | {"preemptions": engine.machine.clock.preemptions}}


def _generation_routes(app: FastAPI, catalog: Catalog, limits: Limits) -> None:
    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        route = GenerateRoute(_loop(request), body, limits)
        return await route.stream() if body.stream else await route.respond(request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        catalog.check(body.model)
        route = CompletionsRoute(_loop(request), body, catalog.name, limits)
        return await route.stream() if body.stream else await route.respond(request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        catalog.check(body.model)
        route = ChatRoute(_loop(request), body, catalog.name, limits)
        return await route.stream() if body.stream else await route.respond(request)
