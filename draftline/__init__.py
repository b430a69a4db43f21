"""draftline: a speculative-decoding inference engine (DFlash, EAGLE-3, MTP; lossless).

    from draftline import Engine, SamplingParams

    engine = Engine.from_spec("specs/tiny-dflash.yaml")
    out = engine.generate(["def add(a, b):"], SamplingParams(max_new_tokens=32))

Subpackages: ``draftline.core`` (specs, the state machine, sampling, models, methods, training),
``draftline.backends`` (``reference`` and ``cuda``) and ``draftline.api`` (the HTTP server).
Importing this package loads nothing heavy: each name below is imported on first use.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

# In a source checkout core/, backends/ and api/ sit at the repository's top level, next to
# this folder; pyproject maps them into this namespace for an install. Searching the top level
# for subpackages too gives a checkout run with `PYTHONPATH=.` (or `python -m draftline` from
# its root) the same `draftline.core` an install has. An installed wheel holds them here.
_HERE = Path(__file__).resolve().parent
if not (_HERE / "core").is_dir() and (_HERE.parent / "core" / "__init__.py").is_file():
    __path__.append(str(_HERE.parent))  # noqa: F821 (a package's own __path__)

# public name -> the module that defines it
_PUBLIC = {
    "Engine": "draftline.core.engine",
    "Completion": "draftline.core.engine",
    # the errors a caller can get: a bad spec, a checkpoint or config that cannot be loaded, a
    # request (or SamplingParams) the engine cannot run; each message names the fix
    "SpecError": "draftline.core.spec",
    "ConfigError": "draftline.core.models.config",
    "CheckpointError": "draftline.core.models.checkpoint",
    "RequestError": "draftline.core.errors",
    "SamplingParams": "draftline.core.sampling",
    "Spec": "draftline.core.spec",
    "load_spec": "draftline.core.spec",
}
__all__ = sorted(_PUBLIC)

if TYPE_CHECKING:
    from draftline.core.engine import Completion, Engine
    from draftline.core.errors import RequestError
    from draftline.core.models.checkpoint import CheckpointError
    from draftline.core.models.config import ConfigError
    from draftline.core.sampling import SamplingParams
    from draftline.core.spec import Spec, SpecError, load_spec


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'draftline' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__() -> list[str]:
    return __all__
