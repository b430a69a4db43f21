"""Value types for the command line's flags.

Sampling flags take the very bounds the spec and the API enforce (``options``' ``Annotated``
types), so ``--temperature -1`` or ``nan`` is refused as ``sampling.temperature: -1`` would
be; the other numeric flags get their own ranges. A bad value is an argparse error: one
line naming the flag and the fix.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable

from pydantic import TypeAdapter, ValidationError

from .options import NewTokens, Seed, Temperature


def bounded(annotated: Any, kind: type) -> Callable[[str], Any]:
    """A flag value checked against a pydantic ``Annotated`` type."""
    adapter = TypeAdapter(annotated)

    def parse(text: str) -> Any:
        try:
            value = kind(text)
            if kind is float and math.isnan(value):
                raise argparse.ArgumentTypeError(f"{text}: not a number; give a finite value")
            return adapter.validate_python(value)
        except ValueError as exc:  # ValidationError is one; so is float("x")
            raise argparse.ArgumentTypeError(_reason(exc, text)) from None

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid ... value" message
    return parse


def _reason(exc: ValueError, text: str) -> str:
    msg = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else f"not a number: {text!r}"
    return f"{text}: {msg[0].lower() + msg[1:]}"


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            span = f"from {low} to {high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{text}: must be an integer {span}")
        return value

    parse.__name__ = "int"
    return parse


def real(low: float, strict: bool = False, high: float | None = None) -> Callable[[str], float]:
    """A finite float above ``low`` (``strict``) or at least ``low``, and at most ``high``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"{text}: must be a finite number {'>' if strict else '>='} {low}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{text}: must be at most {high}")
        return value

    parse.__name__ = "float"
    return parse


def share() -> Callable[[str], float]:
    """0 (keep the spec's value) or a finite share in (0, 1]."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (value == 0 or 0 < value <= 1):  # NaN fails both
            raise argparse.ArgumentTypeError(f"{text}: must be a share in (0, 1], or 0 for the spec's")
        return value

    parse.__name__ = "float"
    return parse


def listed(item: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """A comma-separated list, each entry checked by ``item``."""

    def parse(text: str) -> list[Any]:
        entries = [t.strip() for t in text.split(",") if t.strip()]
        if not entries:
            raise argparse.ArgumentTypeError("give at least one value (comma-separated)")
        return [item(t) for t in entries]

    parse.__name__ = "list"
    return parse


def choice(*names: str) -> Callable[[str], str]:
    """One of ``names``."""

    def parse(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(names)}")
        return text

    parse.__name__ = "choice"
    return parse


TEMPERATURE = bounded(Temperature, float)
NEW_TOKENS = bounded(NewTokens, int)
SEED = bounded(Seed, int)
POSITIVE = integer(1)
NON_NEGATIVE = integer(0)
PORT = integer(1, 65535)
