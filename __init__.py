"""A clone imported from the folder that holds it (`cd ..` then `from draftline import Engine`,
with the clone named draftline): Python finds this folder before the installed package, so it
has to be the same package, `draftline/__init__.py` run here, not an empty namespace.

An install never holds this file: pyproject maps draftline/, core/, backends/ and api/ alone.
"""

from pathlib import Path

_ROOT = Path(__file__).resolve().parent
# draftline/ first (cli, __main__), then the top level (core, backends, api)
__path__ = [str(_ROOT / "draftline"), str(_ROOT)]
_INNER = _ROOT / "draftline" / "__init__.py"
exec(compile(_INNER.read_text(encoding="utf-8"), str(_INNER), "exec"))
