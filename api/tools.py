"""Tool calls on /v1/chat/completions: ``tools`` reach the chat template; ``tool_choice``
decides how calls are made.

- ``none``: no calls are parsed; the text is the message's content.
- ``auto`` (the default when tools are given): the model writes calls in its template's format,
  which a parser from PARSERS reads back (``hermes``: ``<tool_call>{"name", "arguments"}</tool_call>``,
  as Qwen3's template and the shipped tiny template ask).
- ``required``: a grammar holds the output to a JSON array of one or more calls, each a
  function's name with arguments matching its JSON schema.
- a named function: a grammar holds the output to that function's arguments (its schema).

The grammars are ordinary constraints (core/grammar.py), so drafting keeps them lossless.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Literal

from pydantic import Field

from draftline.core.engine import RequestError
from draftline.core.grammar import Constraint

from .structured import Strict

ANY_OBJECT = {"type": "object"}  # a function without a parameters schema takes any object


class FunctionDef(Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # arguments are always held to the schema when a grammar enforces the call


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_dict(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index} | out


TAG_OPEN, TAG_CLOSE = "<tool_call>", "</tool_call>"
HERMES_CALL = re.compile(re.escape(TAG_OPEN) + r"\s*(.*?)\s*" + re.escape(TAG_CLOSE), re.DOTALL)


def hermes(text: str) -> tuple[str | None, list[Call]]:
    """Hermes-style calls: each ``<tool_call>`` holds a JSON object with ``name`` and
    ``arguments``; the text before the first call is the content. Text whose calls do not
    parse is all content (as vLLM's parser returns it)."""
    calls = []
    for body in HERMES_CALL.findall(text):
        try:
            obj = json.loads(body)
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        calls.append(Call(obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False)))
    if not calls:
        return text, []
    content = text[: text.index(TAG_OPEN)].strip()
    return content or None, calls


PARSERS: dict[str, Callable[[str], tuple[str | None, list[Call]]]] = {"hermes": hermes}


@dataclass(frozen=True)
class ToolPlan:
    """One request's tools (as the template reads them) and how its calls are made."""

    tools: tuple[dict[str, Any], ...]
    mode: str  # none | auto | required | named
    name: str | None = None  # the named function
    parallel: bool = True  # more than one call per turn (parallel_tool_calls)
    parser: str = "hermes"

    @staticmethod
    def of(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None = None) -> "ToolPlan | None":
        """The plan for a request (None: no tools, nothing to do), or a RequestError."""
        if not tools:
            if choice not in (None, "none", "auto"):
                raise RequestError("tool_choice: a function is required but no `tools` are given; give tools or drop "
                                   "tool_choice", "tool_choice")
            return None
        names = [t.function.name for t in tools]
        if len(set(names)) < len(names):
            raise RequestError("tools: two functions share a name; give each function its own name", "tools")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise RequestError(f"tool_choice names function {choice.function.name!r}, which is not among the "
                                   f"tools ({', '.join(names)}); name one of them", "tool_choice")
            return ToolPlan(tuple(t.model_dump(exclude_none=True) for t in tools), "named", choice.function.name)
        return ToolPlan(tuple(t.model_dump(exclude_none=True) for t in tools), choice or "auto",
                        parallel=parallel is not False)

    def _schema(self, name: str) -> dict[str, Any]:
        found = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return found.get("parameters") or ANY_OBJECT

    def constraint(self) -> Constraint | None:
        """The grammar a required or named choice holds the output to."""
        if self.mode == "named":
            return Constraint("json_schema", json.dumps(self._schema(self.name)))
        if self.mode != "required":
            return None
        one = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                  "arguments": self._schema(t["function"]["name"])},
                "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": one}} | ({} if self.parallel else {"maxItems": 1})
        return Constraint("json_schema", json.dumps(calls))

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        """(content, calls) of a finished output. An output the grammar did not let finish (cut
        at max_tokens) has no calls: its text is the content."""
        if self.mode == "none":
            return text, []
        if self.mode == "auto":
            content, calls = PARSERS[self.parser](text)
            return content, calls if self.parallel else calls[:1]
        try:
            value = json.loads(text)
        except ValueError:
            return text, []
        if self.mode == "named":
            return None, [Call(self.name, json.dumps(value, ensure_ascii=False))]
        return None, [Call(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in value]


def _held(text: str) -> int:
    """Characters at the end of ``text`` that may begin a call's opening tag (held back)."""
    return next((k for k in range(min(len(TAG_OPEN) - 1, len(text)), 0, -1) if text.endswith(TAG_OPEN[:k])), 0)


class ToolStream:
    """One streamed choice under a tool plan, fed its whole text so far: content deltas while
    no call can have begun; a named call's arguments as they come; other calls, once parsed at
    the end, as OpenAI ``tool_calls`` deltas (an index, id, type, name and arguments each)."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.sent, self.opened = plan, 0, False

    def _content(self, text: str, upto: int) -> list[dict[str, Any]]:
        new, self.sent = text[self.sent:upto], max(self.sent, upto)
        return [{"content": new}] if new else []

    def feed(self, text: str) -> list[dict[str, Any]]:
        mode = self.plan.mode
        if mode == "none":
            return self._content(text, len(text))
        if mode == "named":
            out = [] if self.opened else [{"tool_calls": [Call(self.plan.name, "").to_dict(0)]}]
            self.opened = True
            new, self.sent = text[self.sent:], len(text)
            return out + ([{"tool_calls": [{"index": 0, "function": {"arguments": new}}]}] if new else [])
        if mode == "required":
            return []
        upto = text.index(TAG_OPEN) if TAG_OPEN in text else len(text) - _held(text)
        return self._content(text, upto)

    def finish(self, text: str) -> tuple[list[dict[str, Any]], bool]:
        """The last deltas of a finished output, and whether it made calls."""
        deltas = self.feed(text)
        content, calls = self.plan.parse(text)
        if not calls:
            return deltas + self._content(text, len(text)), False
        if self.plan.mode == "named":
            return deltas, True
        if self.plan.mode == "auto":
            deltas += self._content(text, text.index(TAG_OPEN))
        return deltas + [{"tool_calls": [c.to_dict(i) for i, c in enumerate(calls)]}], True
