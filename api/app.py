"""The FastAPI app: a thin layer from request models to the engine loop."""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from core.engine import Completion, RequestError
from core.loop import EngineDead, EngineLoop, Handle, QueueFull
from core.machine import describe_transitions

from .metrics import Metrics
from .schemas import CompletionRequest, GenerateRequest, SamplingIn


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
        plan = loop.engine.plan
        return {"spec": loop.engine.spec.model_dump(mode="json"), "plan": plan.__dict__ | {"target_layer_ids": list(plan.target_layer_ids)},
                "phases": describe_transitions(), "draft_policy": loop.engine.policy.table()}


def _generation_routes(app: FastAPI, loop: EngineLoop, auth: Any) -> None:
    @app.post("/generate", dependencies=[auth])
    async def generate(body: GenerateRequest):
        handle = loop.submit(body.prompt, body.sampling_params.params(), body.speculative, body.sampling_params.stops())
        if body.stream:
            return _sse(_native_chunks(handle), handle)
        c = await handle.result()
        return {"text": c.text, "output_ids": c.output_ids, "meta_info": c.meta_info}

    @app.post("/v1/completions", dependencies=[auth])
    async def completions(body: CompletionRequest):
        sampling: SamplingIn = body.sampling()
        handle = loop.submit(body.prompt, sampling.params(), True, sampling.stops())
        head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
                "model": body.model or model_name(loop)}
        if body.stream:
            return _sse(_openai_chunks(handle, head), handle)
        c = await handle.result()
        return head | {"choices": [_choice(c.text, c)], "usage": _usage(c)}


def _finish(c: Completion) -> str:
    kind = (c.meta_info["finish_reason"] or {}).get("type")
    return {"length": "length", "stop": "stop"}.get(kind, "abort")


def _choice(text: str, c: Completion | None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": None if c is None else _finish(c)}


def _usage(c: Completion) -> dict[str, int]:
    m = c.meta_info
    return {"prompt_tokens": m["prompt_tokens"], "completion_tokens": m["completion_tokens"],
            "total_tokens": m["prompt_tokens"] + m["completion_tokens"]}


async def _native_chunks(handle: Handle) -> AsyncIterator[dict[str, Any]]:
    async for u in handle.updates():
        c = u.finished
        meta = c.meta_info if c is not None else {"id": str(handle.req.rid), "finish_reason": None,
                                                  "completion_tokens": len(u.output_ids)}
        yield {"text": c.text if c else u.text, "output_ids": u.output_ids, "meta_info": meta}


async def _openai_chunks(handle: Handle, head: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    sent = ""
    async for u in handle.updates():
        text = u.finished.text if u.finished else u.text
        delta, sent = text[len(sent):], text
        chunk = head | {"choices": [_choice(delta, u.finished)]}
        yield chunk | ({"usage": _usage(u.finished)} if u.finished else {})


def _sse(chunks: AsyncIterator[dict[str, Any]], handle: Handle) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        done = False
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            done = True
            yield b"data: [DONE]\n\n"
        finally:
            if not done:  # the client went away mid-stream: free its slot at the next step
                handle.cancel()

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
