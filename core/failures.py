"""A command's failure as the one line the user reads: what is wrong, where, and the fix.

The errors draftline raises on bad input (SpecError, ConfigError, CheckpointError,
RequestError) already say so; a file the operating system refused is named with its reason;
anything else is unexpected and says how to see its traceback."""

from __future__ import annotations


def failure_line(exc: BaseException) -> str:
    from .engine import RequestError
    from .models.checkpoint import CheckpointError
    from .models.config import ConfigError
    from .spec import SpecError

    if isinstance(exc, SpecError):
        text = f"{exc.source}: " + "; ".join(exc.messages)
    elif isinstance(exc, (ConfigError, CheckpointError, RequestError)):
        text = str(exc)
    elif isinstance(exc, OSError) and exc.filename is not None:
        text = f"{exc.filename}: {exc.strerror or exc}"
    else:
        text = f"{type(exc).__name__}: {exc} (unexpected: rerun with --debug for the traceback, and report it)"
    return " ".join(text.split("\n"))  # one line, however the message was written
