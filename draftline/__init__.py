"""draftline: a speculative-decoding inference engine (DFlash, EAGLE-3, MTP; lossless).

Subpackages: ``draftline.core`` (specs, the state machine, sampling, models, methods, training),
``draftline.backends`` (``reference`` and ``cuda``) and ``draftline.api`` (the HTTP server).
"""

from pathlib import Path

# In a source checkout core/, backends/ and api/ sit at the repository's top level, next to
# this folder; pyproject maps them into this namespace for an install. Searching the top level
# for subpackages too gives a checkout run with `PYTHONPATH=.` (or `python -m draftline` from
# its root) the same `draftline.core` an install has. An installed wheel holds them here.
_HERE = Path(__file__).resolve().parent
if not (_HERE / "core").is_dir() and (_HERE.parent / "core" / "__init__.py").is_file():
    __path__.append(str(_HERE.parent))  # noqa: F821 (a package's own __path__)
