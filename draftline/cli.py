"""The `draftline` command: core's commands and the server's (``draftline.api.commands``).
The console script and ``python -m draftline`` run ``main``."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from draftline.api.commands import add_commands
    from draftline.core.cli import main as run

    return run(argv, serving=add_commands)
