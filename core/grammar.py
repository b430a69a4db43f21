"""Structured outputs: a request's constraint (a JSON schema, any JSON object, a regex, a
choice among strings, an EBNF grammar) compiled by xgrammar over the target's tokenizer, and
the per-request matcher that masks logits.

With drafting, a round's verify slot j is masked by the grammar's state after the request's
tokens and drafts 0 .. j-1 (``mask_window``), exactly the mask plain decoding would apply there
if those drafts are accepted; a draft the grammar forbids has probability 0 at its slot, so the
acceptance rule rejects it as it rejects any token the target would not emit. The matcher walks
the drafts to build the masks and rolls them back, then advances by the tokens the round keeps.
Greedy output with drafting therefore equals constrained plain decoding, and sampled output
keeps its law.

Before the verify, each constrained row's drafts are chosen again under the masks: the walk
and the choices are core/walk.py.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .errors import RequestError
from .walk import Chooser, walk

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
CACHED = 256  # compiled grammars kept (a repeated schema costs nothing)
EXTRA = "pip install 'draftline[structured]' (xgrammar)"
RUN_WEIGHT = 0.3  # a drafted round's weight in the moving average of accepted runs


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match: ``kind`` one of KINDS; ``source`` the schema as JSON
    text, the regex, the choices as a JSON list of strings, or the EBNF grammar (empty for
    json_object)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RequestError(f"structured output kind {self.kind!r}: use one of {', '.join(KINDS)}")

    @staticmethod
    def choices(options: list[str]) -> "Constraint":
        return Constraint("choice", json.dumps(options))


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise RequestError(f"structured outputs need xgrammar, which is not installed here: {EXTRA}") from None
    return xgrammar


def vocab_kind(tokenizer_json: dict[str, Any]) -> str:
    """How the tokenizer writes bytes in its vocabulary (xgrammar's VocabType name):
    byte-level (GPT-2 style), byte fallback (SentencePiece's <0x..> tokens) or raw."""
    decoder = tokenizer_json.get("decoder") or {}
    parts = [decoder, *decoder.get("decoders", [])]
    if any(p.get("type") == "ByteLevel" for p in parts):
        return "BYTE_LEVEL"
    if any(p.get("type") == "ByteFallback" for p in parts):
        return "BYTE_FALLBACK"
    return "RAW"


class Grammars:
    """Compiles constraints for one target's tokenizer, keeping the last CACHED compiled."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        encoded = [""] * vocab_size
        for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
            if i < vocab_size:
                encoded[i] = token
        kind = getattr(xgr.VocabType, vocab_kind(json.loads(tokenizer.to_str())))
        info = xgr.TokenizerInfo(encoded, kind, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.cache: OrderedDict[Constraint, Any] = OrderedDict()
        self.lock = threading.Lock()  # requests are prepared on worker threads
        self.batch = None  # xgrammar's batch matcher (made with the first matcher): a batch's rows walk together

    def compile(self, c: Constraint) -> tuple[Any, float]:
        """(the compiled grammar, ms spent compiling it: 0 when the cache had it), or a
        RequestError naming what is wrong with the constraint."""
        with self.lock:
            if c in self.cache:
                self.cache.move_to_end(c)
                return self.cache[c], 0.0
        start = time.perf_counter()
        try:
            compiled = self._compile(c)
        except RequestError:
            raise
        except Exception as exc:  # noqa: BLE001 (xgrammar raises RuntimeError / ValueError with its parser's message)
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            reason = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", reason)[:200]  # the compiler's log prefix: time, source line
            raise RequestError(f"{c.kind}: does not compile ({reason}); fix it or drop the constraint",
                               param="response_format") from None
        with self.lock:
            self.cache[c] = compiled
            if len(self.cache) > CACHED:
                self.cache.popitem(last=False)
        return compiled, 1e3 * (time.perf_counter() - start)

    def _compile(self, c: Constraint):
        # JSON on one line with json.dumps' separators: free whitespace lets a model pad forever
        if c.kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if c.kind == "json_schema":
            return self.compiler.compile_json_schema(c.source, any_whitespace=False, strict_mode=True)
        if c.kind == "regex":
            return self.compiler.compile_regex(c.source)
        if c.kind == "grammar":
            return self.compiler.compile_grammar(c.source)
        options = json.loads(c.source)
        if not options or not all(isinstance(o, str) for o in options):
            raise RequestError("choice: give a non-empty list of strings", param="guided_choice")
        return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(o) for o in options))

    def matcher(self, c: Constraint, stop_ids: list[int]) -> "Matcher":
        """A fresh matcher for one request, ending at one of ``stop_ids``."""
        compiled, ms = self.compile(c)
        xgr = _xgrammar()
        if self.batch is None:  # one thread: handing a slot's small fills to more cost more than the fills
            self.batch = xgr.BatchGrammarMatcher(max_threads=1)
        return Matcher(xgr.GrammarMatcher(compiled, override_stop_tokens=stop_ids), self.vocab_size, ms, self.batch)


class Matcher:
    """One request's grammar state: masks for a round's verify slots, advanced by kept tokens."""

    def __init__(self, matcher, vocab_size: int, compile_ms: float, batch):
        self.matcher, self.vocab_size, self.compile_ms, self.batch = matcher, vocab_size, compile_ms, batch
        self.mask_s = 0.0  # host time spent building and applying masks
        self.rounds = 0  # mask windows built (one per round, plain or drafted)
        self.refused = 0  # drafts the grammar forbade (each rejected at its slot, a wasted draft)
        self.replaced = 0  # forbidden drafts replaced by one the grammar allows (the drafter's best, or a forced one)
        self.accepted: float | None = None  # drafts a drafted round accepted, a moving average (reach)
        self._drafted = False  # the last window walked drafts: the next advance is a drafted round's

    def mask_window(self, x: Tensor, drafts: Tensor | None) -> Tensor:
        """x [T, V] logits at a round's slots (slot j after drafts 0 .. j-1) -> masked (a float32
        copy): slot j allows what the grammar allows after those drafts. Slots past the first
        draft the grammar refuses are left as they are: the refused draft is rejected, so they
        are never sampled from."""
        xgr = _xgrammar()
        bitmask = xgr.allocate_token_bitmask(x.shape[0], self.vocab_size)  # all allowed
        self.fill_window(bitmask, None if drafts is None else drafts.tolist())
        start = time.perf_counter()
        out = x.float().clone()
        xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device), vocab_size=self.vocab_size)
        self.mask_s += time.perf_counter() - start
        return out

    def fill_window(self, bitmask: Tensor, drafts: list[int] | None, choose: Chooser | None = None,
                    reach: int | None = None) -> list[int]:
        """The masks of a round's slots into bitmask [T, ceil(V / 32)] int32 (a host tensor, all
        allowed on entry; slot j after drafts 0 .. j-1), as mask_window applies them; the
        matcher walks the drafts and rolls back. ``choose(j, words)``: the token slot j drafts
        instead of drafts[j] (replaced in place), given the slot's mask row, or None to keep
        it -> the slots whose draft changed. One walk gives the chosen drafts and their masks.
        ``reach``: walk no further than that draft, which becomes a token its slot's mask forbids
        (rejected there, so the slots after it are never read: their masks are left unfilled)."""
        last = 0 if drafts is None else bitmask.shape[0] - 1
        return walk([self], bitmask, [0], [drafts], [choose], [reach], last)[0]

    def reach(self, drafts: int) -> int:
        """How many of a round's ``drafts`` are worth walking: each slot walked costs a mask, and
        past the runs this request's rounds keep, slots are rarely accepted. 1.5 times the mean
        run accepted (a moving average), plus one, so a run that grows can be seen growing."""
        return drafts if self.accepted is None else min(drafts, int(1.5 * self.accepted) + 1)

    def choose(self, drafts: list[int], choose: Chooser) -> list[int]:
        """fill_window's walk with its masks unused (the round's own masks count its refusals):
        ``drafts`` chosen in place -> the slots whose draft changed."""
        counts = self.mask_s, self.rounds, self.refused
        changed = self.fill_window(_xgrammar().allocate_token_bitmask(len(drafts) + 1, self.vocab_size), drafts, choose)
        self.mask_s, self.rounds, self.refused = counts
        return changed

    def advance(self, tokens: list[int]) -> None:
        """The tokens a round keeps, each allowed by its slot's mask."""
        if self._drafted:  # the drafts it accepted: all but the last token
            run = len(tokens) - 1
            self.accepted = run if self.accepted is None else (1 - RUN_WEIGHT) * self.accepted + RUN_WEIGHT * run
            self._drafted = False
        for token in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(token):
                raise RuntimeError(f"grammar: kept token {token} was not allowed by its mask")

    @property
    def done(self) -> bool:
        return self.matcher.is_terminated()
