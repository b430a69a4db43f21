"""When a request stops: every rule in one place. The machine applies them to each collected
round (and to the prefill's token); nothing else decides that a request is done."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .request import Request


class Stops:
    """``decode`` turns a request's output ids into text, for stop strings."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode

    @staticmethod
    def cut(req: Request, tokens: list[int]) -> tuple[list[int], dict[str, Any] | None]:
        """The tokens of a round to keep and, when the request ends inside them, why: a stop
        id (kept), max_new_tokens or max_model_len."""
        out, total = len(req.output_ids), len(req.prompt_ids) + len(req.output_ids)
        if req.params.max_new_tokens == 0:  # the prompt only (its logprobs): the prefill's token is dropped
            return [], {"type": "length", "length": 0}
        n = len(tokens)
        if out + n < req.params.max_new_tokens and total + n < req.max_model_len and req.stop_ids.isdisjoint(tokens):
            return tokens, None  # the common case: every token kept, decided without a loop in Python
        for i, tok in enumerate(tokens, 1):
            if tok in req.stop_ids:
                return tokens[:i], {"type": "stop", "matched": tok}
            if out + i >= req.params.max_new_tokens or total + i >= req.max_model_len:
                return tokens[:i], {"type": "length", "length": out + i}
        return tokens, None

    @staticmethod
    def watching(req: Request) -> bool:
        """Whether stop strings apply to the request now: it has some, and its min_new_tokens
        are out."""
        return bool(req.stop_strings) and len(req.output_ids) >= req.params.min_new_tokens

    def matched_string(self, req: Request) -> str | None:
        """The stop string that occurs first in the request's text, if any (the text is decoded
        only for a request that has stop strings: every row pays for it every round)."""
        if not self.watching(req):
            return None
        hit = self.stop_at(req, self.decode(req.output_ids))
        return None if hit is None else hit[1]

    def stop_at(self, req: Request, text: str) -> tuple[int, str] | None:
        """(where, which) of the earliest stop string in ``text`` (the request's output text).
        Under min_new_tokens, stop strings count only after the text of those first tokens."""
        if not self.watching(req):
            return None
        start = len(self.decode(req.output_ids[: req.params.min_new_tokens])) if req.params.min_new_tokens else 0
        hits = [(text.find(s, start), s) for s in req.stop_strings]
        return min(((i, s) for i, s in hits if i >= 0), default=None)

    def apply(self, req: Request, tokens: list[int]) -> list[int]:
        """Append what the request keeps of ``tokens``; finish it if a rule says so."""
        kept, reason = self.cut(req, tokens)
        req.append(kept)
        if reason is None:
            hit = self.matched_string(req)
            reason = None if hit is None else {"type": "stop", "matched": hit}
        if reason is not None:
            req.finish(reason)
        return kept

    @staticmethod
    def done_in_flight(req: Request, rounds: int) -> bool:
        """Whether ``rounds`` launched rounds surely end the request by a length limit (each
        round emits a token at least), so that a further round would be thrown away. Only then
        is it held out of the next round: held on its mean tokens a round instead, one request
        in nine fell short, and its next round then came depth + 1 steps after its last tokens,
        its stream's longest gap by far."""
        return rounds >= min(req.params.max_new_tokens - len(req.output_ids), req.max_model_len - req.seq_len)
