"""A JSONL file of prompts, one ``{"prompt": "..."}`` per line, read with each problem named:
the file, the line and the fix (a binary file, a line that is not JSON, a record without a
string ``prompt``, a file with none)."""

from __future__ import annotations

import json
from pathlib import Path

from .models.config import ConfigError

FIX = 'write one JSON object per line, {"prompt": "..."}'


def read_prompt_file(path: str | Path) -> list[str]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found; give a JSONL file of prompts ({FIX})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (not UTF-8); {FIX}") from None
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not JSON ({exc.msg}); {FIX}") from None
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if not isinstance(prompt, str):
            found = f"fields {', '.join(sorted(record))[:80]}" if isinstance(record, dict) else type(record).__name__
            raise ConfigError(f"{path}:{number}: no string `prompt` ({found}); {FIX}")
        prompts.append(prompt)
    if not prompts:
        raise ConfigError(f"{path}: no prompts in it; {FIX}")
    return prompts
