"""The error a request the engine cannot run raises. Its own module, below everything that
checks requests (sampling parameters, the engine, the server's limits), so each can raise it."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine cannot run; the message names the problem and the fix, and
    ``param`` the request field at fault where there is one (the HTTP error's ``param``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
