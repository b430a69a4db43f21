"""Built-in drafting methods; each module registers itself in ``draftline.core.registry.METHODS``."""

from . import dflash, eagle3, gemma4_mtp, none  # noqa: F401
