"""Built-in drafting methods; each module registers itself in ``core.registry.METHODS``."""

from . import dflash, none  # noqa: F401
