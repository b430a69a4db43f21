"""Every error a client can get, in OpenAI's shape: ``{"error": {"message", "type", "param",
"code"}}``, a 4xx for anything the request did (400 invalid, 401 no key, 404 unknown model or
route, 413 too large), a 503 for what can succeed later (with ``Retry-After`` where waiting
helps). A message names the field and the fix and never echoes the rejected value: a NaN
cannot be written back as JSON, and a 5 MB value should not come back as 5 MB."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from draftline.core.errors import RequestError
from draftline.core.loop import EngineDead, QueueFull, ShuttingDown

from .catalog import UnknownModel
from .metrics import Metrics

KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "request_too_large", 503: "unavailable"}
# a pydantic error type -> what to do about it (its own message, where it says the bound, is used otherwise)
FIXES = {
    "extra_forbidden": "unknown field; remove it or fix its spelling (the schema is at /openapi.json)",
    "missing": "required field is missing",
    "finite_number": "must be a finite number (NaN and Infinity are refused)",
    "bool_type": "must be true or false (a JSON boolean, not a string or a number)",
    "int_type": "must be an integer (a JSON number without a fraction, not a string)",
    "float_type": "must be a number (not a string or a boolean)",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be an object",
    "model_attributes_type": "must be a JSON object",
    "model_type": "must be a JSON object",
}
TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "tuple"}  # a union member, in pydantic's locations
SHOWN = 3  # problems listed in one message


class ClientGone(Exception):
    """The client disconnected before its answer was ready (its requests are cancelled)."""


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": KINDS.get(status, "invalid_request_error"), "param": param,
                      "code": status}}


def error(status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status, headers=headers)


def _where(loc: tuple[Any, ...]) -> tuple[str, bool]:
    """A pydantic location as the request's field path ("sampling_params.stop.0"), and whether
    it passed through a union (whose members pydantic names in the location)."""
    parts, union = [], False
    for p in loc[1:] if loc and loc[0] == "body" else loc:
        text = str(p)
        if text == "[key]":  # pydantic's mark on an invalid dict key, named just before it
            continue
        if isinstance(p, str) and ("[" in text or text in TYPE_TAGS or text.startswith("function-")):
            union = True
            continue
        parts.append(text if len(text) <= 40 else text[:37] + "...")  # a dict key is the client's text
    return ".".join(parts), union


def _fix(err: dict[str, Any]) -> str:
    if err["type"] == "json_invalid":
        return f"the body is not valid JSON ({err.get('ctx', {}).get('error', 'decode error')})"
    text = FIXES.get(err["type"]) or str(err["msg"]).removeprefix("Value error, ")
    return text if len(text) <= 200 else text[:197] + "..."


def describe(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """(message, the first field at fault) for pydantic's errors: each field once (a union's
    members each complain about the same field), at most SHOWN of them."""
    fields: dict[str, str] = {}
    for err in errors:
        where, union = _where(tuple(err["loc"])) if err["type"] != "json_invalid" else ("", False)
        if where not in fields:
            fields[where] = _fix(err) + (" (or another of the forms it accepts: see /openapi.json)" if union else "")
    items = list(fields.items())
    parts = [f"{where}: {fix}" if where else fix for where, fix in items[:SHOWN]]
    if len(items) > SHOWN:
        parts.append(f"and {len(items) - SHOWN} more")
    return "; ".join(parts), (items[0][0] or None) if items else None


def install(app: FastAPI, metrics: Metrics) -> None:
    """The app's handlers: each error type to its status and OpenAI-shaped body."""

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.rejected.labels(reason="invalid").inc()
        return error(400, *describe(list(exc.errors())))

    @app.exception_handler(RequestError)
    async def bad_request(_: Request, exc: RequestError) -> JSONResponse:
        metrics.rejected.labels(reason="invalid").inc()
        return error(400, str(exc), exc.param)

    @app.exception_handler(UnknownModel)
    async def unknown_model(_: Request, exc: UnknownModel) -> JSONResponse:
        metrics.rejected.labels(reason="unknown_model").inc()
        return error(404, exc.message, "model")

    @app.exception_handler(HTTPException)
    async def http(_: Request, exc: HTTPException) -> JSONResponse:
        message = {404: "no such route; the routes are listed at /docs",
                   405: "method not allowed on this route; see /docs"}.get(exc.status_code, str(exc.detail))
        return error(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(QueueFull)
    async def full(_: Request, exc: QueueFull) -> JSONResponse:
        metrics.rejected.labels(reason="queue_full").inc()
        return error(503, str(exc), headers={"Retry-After": "1"})

    @app.exception_handler(ShuttingDown)
    async def closing(_: Request, exc: ShuttingDown) -> JSONResponse:
        metrics.rejected.labels(reason="shutting_down").inc()
        return error(503, str(exc))  # no Retry-After: this server will not take it

    @app.exception_handler(EngineDead)
    async def dead(_: Request, exc: EngineDead) -> JSONResponse:
        return error(503, str(exc))

    @app.exception_handler(ClientGone)
    async def gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the connection is closed
