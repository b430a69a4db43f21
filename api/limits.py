"""A request's size, checked before any work is done for it (tokenizing, rendering a chat
template, queueing): the prompts' characters and tokens, the stop strings, n and best_of,
logit_bias, and how many engine requests it makes. Each bound is a ``server.*`` spec field;
the 400 names the field, the bound and the setting that raises it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from draftline.core.errors import RequestError
from draftline.core.spec import Spec

CHARS_PER_TOKEN = 32  # max_prompt_chars' default per token of context: far above any real text's


@dataclass(frozen=True)
class Limits:
    max_prompt_chars: int
    max_prompt_tokens: int  # a prompt must leave room for a token: max_model_len - 1
    max_stop_strings: int
    max_stop_chars: int
    max_n: int
    max_logit_bias: int
    max_requests: int  # engine requests one API request may make (prompts x choices): server.max_queue

    @classmethod
    def of(cls, spec: Spec) -> "Limits":
        s, context = spec.server, spec.model.max_model_len
        return cls(s.max_prompt_chars or CHARS_PER_TOKEN * context, context - 1, s.max_stop_strings,
                   s.max_stop_chars, s.max_n, s.max_logit_bias, s.max_queue)

    def prompts(self, prompts: Sequence[str | Sequence[int]], field: str) -> None:
        for i, p in enumerate(prompts):
            where = field if len(prompts) == 1 else f"{field}.{i}"
            if isinstance(p, str) and len(p) > self.max_prompt_chars:
                raise RequestError(f"{where}: {len(p):,} characters, more than server.max_prompt_chars "
                                   f"({self.max_prompt_chars:,}); shorten the prompt or raise server.max_prompt_chars",
                                   where)
            if not isinstance(p, str) and len(p) > self.max_prompt_tokens:
                raise RequestError(f"{where}: prompt has {len(p):,} tokens, max_model_len is {self.max_prompt_tokens + 1}; "
                                   "shorten the prompt or raise model.max_model_len", where)

    def chat(self, contents: Sequence[str]) -> None:
        """A chat request's messages, by their text's total length (the rendered prompt is
        checked again as a prompt)."""
        total = sum(map(len, contents))
        if total > self.max_prompt_chars:
            raise RequestError(f"messages: {total:,} characters of content, more than server.max_prompt_chars "
                               f"({self.max_prompt_chars:,}); send shorter messages or raise server.max_prompt_chars",
                               "messages")

    def stop(self, stop: str | Sequence[str] | None, field: str) -> None:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > self.max_stop_strings:
            raise RequestError(f"{field}: {len(stops)} stop strings, more than server.max_stop_strings "
                               f"({self.max_stop_strings}); send fewer or raise server.max_stop_strings", field)
        longest = max(map(len, stops), default=0)
        if longest > self.max_stop_chars:
            raise RequestError(f"{field}: a stop string of {longest:,} characters, longer than "
                               f"server.max_stop_chars ({self.max_stop_chars:,}); shorten it or raise "
                               "server.max_stop_chars", field)

    def choices(self, n: int, best_of: int | None, prompts: int, field: str = "n") -> None:
        for name, value in ((field, n), ("best_of", best_of)):
            if value is not None and value > self.max_n:
                raise RequestError(f"{name}: {value}, more than server.max_n ({self.max_n}); ask for fewer "
                                   "completions per prompt or raise server.max_n", name)
        total = prompts * max(n, best_of or n)
        if total > self.max_requests:  # it could never be queued: a 400, not a 503 to retry
            raise RequestError(f"{prompts} prompt(s) x {max(n, best_of or n)} completion(s) = {total} requests, "
                               f"more than server.max_queue ({self.max_requests}) ever holds; send fewer prompts or "
                               "completions per request", "prompt" if prompts > 1 else field)

    def logit_bias(self, bias: dict[Any, Any] | None, field: str) -> None:
        if bias and len(bias) > self.max_logit_bias:
            raise RequestError(f"{field}: {len(bias):,} entries, more than server.max_logit_bias "
                               f"({self.max_logit_bias:,}); send fewer or raise server.max_logit_bias", field)
