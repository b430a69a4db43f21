"""A checkpoint's chat template, rendered as transformers renders it.

The template comes from ``tokenizer_config.json`` (``chat_template``: a string, or a list of
named templates of which "default" is used) or a ``chat_template.jinja`` file beside it. It is
rendered in Jinja's immutable sandbox with transformers' settings (trim_blocks, lstrip_blocks,
loop controls, a ``tojson`` that does not escape HTML, ``raise_exception``, ``strftime_now``)
and the tokenizer's special tokens as variables; the result is tokenized without adding
special tokens, as ``apply_chat_template(tokenize=True)`` does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .config import ConfigError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """A template that failed to render these messages (its raise_exception, or a Jinja error)."""


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; for
    rendering it is its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... from the config
    compiled: jinja2.Template | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.compiled is None:  # a syntax error surfaces when the checkpoint loads, not per request
            object.__setattr__(self, "compiled", _compile(self.source))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               continue_final_message: bool = False, **extra: Any) -> str:
        """The prompt for these messages; ``extra`` are further template variables. With
        ``continue_final_message`` the prompt ends inside the last message, right after its
        text (no end-of-turn): the model continues it. As transformers does, a tag appended to
        that text marks where to cut the rendering."""
        if continue_final_message:
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise ChatTemplateError("continue_final_message needs a final message with text content to continue")
            messages = messages[:-1] + [messages[-1] | {"content": messages[-1]["content"] + CONTINUE_TAG}]
        try:
            text = self.compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **(self.special_tokens | extra))
        except Exception as exc:  # the template is code from the checkpoint: any failure is this request's
            raise ChatTemplateError(f"the chat template failed on these messages: {exc!r}") from None
        return _cut_at_tag(text) if continue_final_message else text


CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker, so both cut the same rendering at one place


def _cut_at_tag(text: str) -> str:
    """The rendering up to the final message's end (where the tag was appended)."""
    tag = CONTINUE_TAG.strip()
    if tag not in text:
        raise ChatTemplateError("continue_final_message: the chat template does not render the final message's "
                                "text; drop continue_final_message or use a template that keeps it")
    at = text.rindex(tag)
    # a template that keeps the tag's trailing space keeps the message's spacing; else it trimmed both
    return text[:at] if text[at: at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(folder: str | Path | None) -> ChatTemplate | None:
    """The folder's chat template, or None when it ships none."""
    if folder is None:
        return None
    folder = Path(folder)
    config_path = folder / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{config_path}: not valid JSON ({getattr(exc, 'msg', 'not UTF-8 text')}); fix the file, "
                          "or remove it (the checkpoint then has no chat template)") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{config_path}: not a JSON object; fix the file, or remove it")
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    origin = f"{config_path}: chat_template"
    if source is None and (folder / "chat_template.jinja").is_file():
        source, origin = (folder / "chat_template.jinja").read_text(), str(folder / "chat_template.jinja")
    if not source:
        return None
    specials = {k: t for k in SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
    try:
        return ChatTemplate(source, specials)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"{origin} line {exc.lineno}: {exc.message}; fix the template's Jinja syntax") from None
