"""Structured-output fields of every API, mapped onto one core.grammar.Constraint: OpenAI's
``response_format`` (json_object, json_schema), vLLM's ``structured_outputs`` and its older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, and SGLang's
``json_schema`` / ``regex`` / ``ebnf`` sampling params. A request gives at most one."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from draftline.core.engine import RequestError
from draftline.core.grammar import Constraint

MAX_SOURCE = 1 << 16  # characters of a schema, regex or grammar


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JsonSchema(Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # draftline always holds output to the schema


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(Strict):
    """vLLM's ``structured_outputs``: one of its fields."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def _schema(value: str | dict[str, Any], field: str) -> str:
    if isinstance(value, dict):
        return json.dumps(value)
    try:
        json.loads(value)
    except ValueError:
        raise RequestError(f"{field}: not JSON; give the JSON schema as an object or its JSON text", field) from None
    return value


def _one(found: list[tuple[str, Constraint]]) -> Constraint | None:
    if len(found) > 1:
        raise RequestError(f"{', '.join(name for name, _ in found)}: give one structured-output constraint, not "
                           f"{len(found)}", found[1][0])
    if found and len(found[0][1].source) > MAX_SOURCE:
        raise RequestError(f"{found[0][0]}: longer than {MAX_SOURCE} characters; shorten it", found[0][0])
    return found[0][1] if found else None


def openai_constraint(response_format: ResponseFormat | None, outputs: StructuredOutputs | None,
                      guided: dict[str, Any]) -> Constraint | None:
    """The one constraint an OpenAI-shaped request sets (None: none)."""
    found: list[tuple[str, Constraint]] = []
    if response_format is not None and response_format.type == "json_object":
        found.append(("response_format", Constraint("json_object")))
    elif response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None or response_format.json_schema.schema_ is None:
            raise RequestError("response_format.json_schema.schema: required for type json_schema; give the schema "
                               "or use type json_object", "response_format")
        found.append(("response_format", Constraint("json_schema", json.dumps(response_format.json_schema.schema_))))
    if outputs is not None:
        given = [k for k in ("json_", "regex", "choice", "grammar", "json_object") if getattr(outputs, k)]
        found += [(f"structured_outputs.{k.rstrip('_')}", _vllm(k.rstrip("_"), getattr(outputs, k))) for k in given]
    found += [(f"guided_{k}", _vllm(k, v)) for k, v in guided.items() if v is not None]
    return _one(found)


def _vllm(kind: str, value: Any) -> Constraint:
    if kind == "json":
        return Constraint("json_schema", _schema(value, "guided_json"))
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "choice":
        if not value:
            raise RequestError("guided_choice: give at least one string", "guided_choice")
        return Constraint.choices(value)
    return Constraint("regex" if kind == "regex" else "grammar", value)


def native_constraint(json_schema: str | None, regex: str | None, ebnf: str | None) -> Constraint | None:
    """SGLang's sampling_params: json_schema (JSON text), regex or ebnf."""
    found = []
    if json_schema is not None:
        found.append(("json_schema", Constraint("json_schema", _schema(json_schema, "json_schema"))))
    if regex is not None:
        found.append(("regex", Constraint("regex", regex)))
    if ebnf is not None:
        found.append(("ebnf", Constraint("grammar", ebnf)))
    return _one(found)
