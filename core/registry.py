"""Method and backend registries: a name maps to an implementation; duplicate names raise.

Methods register themselves where they are defined (``@METHODS.register("dflash")``).
Backends are registered as lazy ``"module:Class"`` strings so that importing ``draftline.core``
imports neither Triton nor CUDA code.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


class RegistryError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


class Registry:
    def __init__(self, kind: str, loader: Callable[[], None] | None = None):
        self.kind = kind
        self._entries: dict[str, Any] = {}
        self._loader = loader  # imports the modules that declare the built-in entries
        self._loaded = False

    def register(self, name: str, obj: Any = None):
        """Register ``obj`` under ``name``; used bare or as a class decorator."""
        if obj is None:
            return lambda o: self.register(name, o) or o
        self._ensure_loaded()  # so a name clashing with a built-in raises here, not later
        if name in self._entries:
            raise RegistryError(f"{self.kind} {name!r} is already registered; pick another name")
        self._entries[name] = obj
        if isinstance(obj, type):
            obj.name = name
        return obj

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def get(self, name: str) -> Any:
        self._ensure_loaded()
        if name not in self._entries:
            known = ", ".join(sorted(self._entries)) or "none"
            raise RegistryError(f"unknown {self.kind} {name!r}; known: {known}")
        entry = self._entries[name]
        if isinstance(entry, str):  # lazy "module:Class"
            module, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module), attr)
            entry.name = name
            self._entries[name] = entry
        return entry

    def names(self) -> list[str]:
        self._ensure_loaded()
        return sorted(self._entries)

    def _ensure_loaded(self) -> None:
        if not self._loaded and self._loader is not None:
            self._loaded = True
            self._loader()


def _load_builtin_methods() -> None:
    importlib.import_module("draftline.core.methods")


METHODS = Registry("method", _load_builtin_methods)
BACKENDS = Registry("backend")
BACKENDS.register("reference", "draftline.backends.reference.backend:ReferenceBackend")
BACKENDS.register("cuda", "draftline.backends.cuda.backend:CudaBackend")
