"""The model this server answers for, under each name the spec gives it
(``server.served_model_name``, else the checkpoint folder's name): the ``/v1/models``
entries, and the check that a request's ``model`` is one of them (vLLM answers another with
a 404, and so does draftline)."""

from __future__ import annotations

import time
from typing import Any

from draftline.core.spec import Spec


class UnknownModel(LookupError):
    """A request named a model this server does not serve."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class Catalog:
    def __init__(self, spec: Spec):
        given = spec.server.served_model_name
        m = spec.model
        default = m.path.name if m.path is not None else f"random-{m.random_init.preset}"
        self.names: list[str] = [given] if isinstance(given, str) else list(given or [default])
        self.max_model_len = m.max_model_len
        self.created = int(time.time())  # when the server started: OpenAI's `created` of a model

    @property
    def name(self) -> str:
        """The name responses report."""
        return self.names[0]

    def entry(self, name: str) -> dict[str, Any]:
        self.check(name)
        return {"id": name, "object": "model", "created": self.created, "owned_by": "draftline",
                "root": self.name, "max_model_len": self.max_model_len}

    def entries(self) -> list[dict[str, Any]]:
        return [self.entry(n) for n in self.names]

    def check(self, name: str | None) -> None:
        """A request's ``model``: one of the names (or left out: the served model)."""
        if name is not None and name not in self.names:
            shown = name if len(name) <= 80 else name[:77] + "..."
            raise UnknownModel(f"the model `{shown}` does not exist: this server serves "
                               f"{', '.join(repr(n) for n in self.names)} (GET /v1/models)")
