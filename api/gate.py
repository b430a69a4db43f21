"""What every request passes before any route reads it: the bearer token (when the spec sets
``server.api_key_env``; every route but /health), and the body's size (``server.max_request_bytes``:
a declared length over it is refused unread, a body sent in chunks is cut off when it passes
it). One ASGI layer, so nothing behind it, docs and metrics included, is reached without them."""

from __future__ import annotations

import hmac
import json
import os

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from draftline.core.models.config import ConfigError
from draftline.core.spec import Spec

from .errors import error_body

OPEN_PATHS = frozenset({"/health"})  # a load balancer's probe carries no token


def api_token(spec: Spec) -> bytes | None:
    """The bearer token the spec asks for, or None when it asks for none. A variable that is
    named but unset or empty refuses to start: a server would otherwise run open."""
    name = spec.server.api_key_env
    if name is None:
        return None
    value = os.environ.get(name, "")
    if not value.strip():
        state = "is empty" if name in os.environ else "is not set"
        raise ConfigError(f"server.api_key_env names {name}, which {state}: export {name}=<token> before "
                          "starting the server, or remove server.api_key_env to serve without a token")
    return value.strip().encode()


def bearer(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header (the scheme in any case)."""
    for key, value in headers:
        if key.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


class Gate:
    def __init__(self, app: ASGIApp, token: bytes | None, max_bytes: int):
        self.app, self.token, self.max_bytes = app, token, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.token is not None and scope["path"] not in OPEN_PATHS:
            given = bearer(scope["headers"])
            if given is None or not hmac.compare_digest(given, self.token):  # constant time
                return await _refuse(send, 401, "missing or wrong bearer token: send Authorization: Bearer <token>",
                                     {"www-authenticate": "Bearer"})
        length = _declared_length(scope["headers"])
        if length is not None and length > self.max_bytes:
            return await _refuse(send, 413, self._too_large(length), {"connection": "close"})
        await self.app(scope, self._counted(receive), send)

    def _too_large(self, size: int | None) -> str:
        told = f"{size:,} bytes" if size is not None else "the body"
        return (f"{told}: more than server.max_request_bytes ({self.max_bytes:,}); send a smaller request "
                "(fewer or shorter prompts) or raise server.max_request_bytes")

    def _counted(self, receive: Receive) -> Receive:
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:  # a chunked body: the route reading it gets a 413
                raise HTTPException(413, self._too_large(None))
            return message

        return counted


def _declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for key, value in headers:
        if key.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _refuse(send: Send, status: int, message: str, headers: dict[str, str]) -> None:
    body = json.dumps(error_body(status, message)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
