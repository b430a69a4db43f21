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

A draft the grammar forbids would end its round's run there, and a drafter that never saw the
grammar proposes many (a JSON key spelled as the target spells it under the mask is rarely the
drafter's unmasked argmax). So before the verify, each constrained row's drafts are chosen under
the masks (``chosen``): a forbidden draft becomes the drafter's best token the grammar allows
there, read off the drafter's ranking at that slot (its CANDIDATES best tokens, ``candidates``),
the masked argmax the target takes wherever the drafter ranks an allowed token that high.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from .errors import RequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
CACHED = 256  # compiled grammars kept (a repeated schema costs nothing)
EXTRA = "pip install 'draftline[structured]' (xgrammar)"
RUN_WEIGHT = 0.3  # a drafted round's weight in the moving average of accepted runs
CANDIDATES = 64  # a slot's best drafter tokens a forbidden draft is replaced from (32 miss the allowed one often)
LOOK = 32  # candidates checked at a time: most replacements are among the first
Chooser = Callable[[int, np.ndarray], "int | None"]  # (slot, its mask row) -> the slot's draft instead, or None


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
        return Matcher(xgr.GrammarMatcher(compiled, override_stop_tokens=stop_ids), self.vocab_size, ms)


class Matcher:
    """One request's grammar state: masks for a round's verify slots, advanced by kept tokens."""

    def __init__(self, matcher, vocab_size: int, compile_ms: float):
        self.matcher, self.vocab_size, self.compile_ms = matcher, vocab_size, compile_ms
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
        start, walked, changed, matcher = time.perf_counter(), 0, [], self.matcher
        rows = bitmask.numpy()  # the choosers read words on the host: numpy's indexing is cheap
        last = 0 if drafts is None else bitmask.shape[0] - 1
        self._drafted = drafts is not None
        for j in range(last + 1):
            if matcher.is_terminated():  # past its stop token (ignore_eos): nothing left to constrain
                break
            matcher.fill_next_token_bitmask(bitmask, j)
            if j == last:
                break
            if j == reach and (cut := _forbidden(rows[j], self.vocab_size)) is not None:
                drafts[j] = cut
                changed.append(j)
                break
            new = None if choose is None else choose(j, rows[j])
            if new is not None and new != drafts[j]:
                self.replaced += not _allows(rows[j], drafts[j])
                drafts[j] = new
                changed.append(j)
            if not matcher.accept_token(drafts[j]):
                self.refused += 1
                break
            walked += 1
        if walked:
            matcher.rollback(walked)
        self.mask_s += time.perf_counter() - start
        self.rounds += 1
        return changed

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


def _only_token(words: np.ndarray) -> int | None:
    """The one token a bitmask row [ceil(V / 32)] int32 allows, or None if it allows more."""
    set_words = words.nonzero()[0]
    if len(set_words) != 1:
        return None
    i = int(set_words[0])
    bits = int(words[i]) & 0xFFFFFFFF
    return 32 * i + bits.bit_length() - 1 if bits & (bits - 1) == 0 else None


def _first_allowed(words: np.ndarray) -> int | None:
    """The lowest token a bitmask row allows, or None if it allows none."""
    set_words = words.nonzero()[0]
    if not len(set_words):
        return None
    bits = int(words[set_words[0]]) & 0xFFFFFFFF
    return 32 * int(set_words[0]) + (bits & -bits).bit_length() - 1


def _allows(words: np.ndarray, token: int) -> bool:
    return bool((int(words[token >> 5]) >> (token & 31)) & 1)


def _masked_row(x: Tensor, words: np.ndarray) -> Tensor:
    """x [V] float32 on the host with the tokens a bitmask row forbids at -inf (a copy)."""
    return x.masked_fill(~torch.from_numpy(_allowed(words, x.shape[0])), float("-inf"))


def _allowed(words: np.ndarray, vocab: int) -> np.ndarray:
    """A bitmask row [ceil(V / 32)] int32 -> [V] bool, the tokens it allows (bit t % 32 of word t // 32)."""
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab].view(bool)


def _forbidden(words: np.ndarray, vocab: int) -> int | None:
    """A token the bitmask row forbids, or None if it allows them all."""
    banned = np.flatnonzero(~_allowed(words, vocab))
    return int(banned[0]) if banned.size else None


def candidates(scores: Tensor) -> Tensor:
    """scores [..., V] (a drafter's logits at its slots) -> [..., CANDIDATES] int32, its best
    tokens at each slot, best first: what a forbidden draft is replaced from (best_allowed)."""
    return scores.topk(min(CANDIDATES, scores.shape[-1]), dim=-1).indices.int()


def forced(drafts: list[int]) -> Chooser:
    """A chooser that replaces a forbidden draft by the token the grammar forces there, if any."""
    return lambda j, words: None if _allows(words, drafts[j]) else _only_token(words)


def best_allowed(drafts: list[int], ranked: np.ndarray) -> Chooser:
    """A chooser for argmax drafts: a forbidden draft becomes the drafter's best token the grammar
    allows there among its ranked candidates (ranked [K, M] int32 on the host: ``candidates``),
    which is the argmax the drafter would have drafted under the slot's mask; where the grammar
    allows none of them, the lowest token it allows (the one it forces, where it forces one)."""
    def choose(j: int, words: np.ndarray) -> int | None:
        if _allows(words, drafts[j]):
            return None
        for lo in range(0, ranked.shape[1], LOOK):
            c = ranked[j, lo : lo + LOOK]
            ok = (words[c >> 5] >> (c & 31)) & 1  # each candidate's bit
            first = int(ok.argmax())
            if ok[first]:
                return int(c[first])
        return _first_allowed(words)  # the drafter ranks every allowed token low: any of them, as likely

    return choose


def drawn_allowed(req, scores: Tensor, probs: Tensor, row: int) -> Chooser:
    """A chooser for drafts drawn from q: slot j's q becomes the drafter's distribution under
    the slot's mask (its logits masked, then temperature, top-k, top-p as the target's), written
    into probs[row, j], and the draft is drawn from it with the slot's key (Gumbel-max over the
    allowed tokens): the acceptance rule reads the q each draft was drawn from, so it stays exact."""
    from .sampling import SamplingBatch, Stream, probs_from_logits, sample  # sampling's bounds import this module

    batch = SamplingBatch.of([req.params], torch.device("cpu"))

    def choose(j: int, words: np.ndarray) -> int | None:
        x = _masked_row(scores[j].float(), words)
        if not bool(torch.isfinite(x).any()):
            return None
        q = probs_from_logits(x[None], batch)  # [1, V]
        probs[row, j] = q[0].to(probs.device)
        return int(sample(q, batch.seed, torch.tensor([req.seq_len + j]), Stream.DRAFT)[0])

    return choose


def chooser(req, drafts: list[int], proposal, row: int, probs: Tensor | None) -> Chooser:
    """How a constrained row's drafts are chosen under its grammar: from the drafter's logits
    where the proposal kept them (Proposal.scores), else forced tokens only."""
    if proposal.scores is None:
        return forced(drafts)
    scores = proposal.scores[row].float().cpu()  # [K, V]
    return best_allowed(drafts, candidates(scores).numpy()) if probs is None else drawn_allowed(req, scores, probs, row)


def chosen(reqs, proposal):
    """The round's proposal with each constrained row's drafts chosen under its grammar (each
    slot's mask after the chosen drafts before it): the drafter's best allowed token where a
    draft is forbidden, or, for drafts drawn from q, a draw from q under the mask, which
    becomes the slot's q. Without the drafter's logits a forbidden draft is replaced only where
    the grammar forces a token (its q one-hot there). Any such choice is lossless: a draft is
    any token the acceptance rule weighs by the q it was drawn from."""
    if proposal.tokens.shape[1] == 0 or not any(r.grammar is not None for r in reqs):
        return proposal
    tokens, probs = proposal.tokens.clone(), None if proposal.probs is None else proposal.probs.clone()
    for i, req in enumerate(reqs):
        if req.grammar is None:
            continue
        drafts = tokens[i].tolist()
        changed = req.grammar.choose(drafts, chooser(req, drafts, proposal, i, probs))
        for j in changed:
            tokens[i, j] = drafts[j]
            if probs is not None and proposal.scores is None:
                probs[i, j] = 0
                probs[i, j, drafts[j]] = 1
    return type(proposal)(tokens, probs)


def masked(logits: Tensor, reqs, drafts: Tensor | None) -> Tensor:
    """logits [N, T, V] with each constrained request's rows masked (mask_window); unchanged
    when no request is constrained."""
    if not any(r.grammar is not None for r in reqs):
        return logits
    out = logits.float().clone()
    for i, req in enumerate(reqs):
        if req.grammar is not None:
            out[i] = req.grammar.mask_window(out[i], None if drafts is None else drafts[i]).to(out.device)
    return out


def fill_masks(reqs, drafts: list[list[int]] | None, bitmask: Tensor, choosers: list | None = None) -> bool:
    """bitmask [>= N, W, ceil(V / 32)] int32 on the host: each constrained request's slot masks
    (Matcher.fill_window after its drafts, chosen in place by ``choosers[i]`` where given, each
    walked only as far as its Matcher.reach), every other row (and a None one: padding) all
    allowed -> whether any draft changed. A plain round's
    (no drafts) in one loop over the matchers, its host time shared among them: a batch's masks
    are on the path between two of its rounds."""
    bitmask.fill_(-1)
    if drafts is not None:
        return any([req.grammar.fill_window(bitmask[i], drafts[i], None if choosers is None else choosers[i],
                                            req.grammar.reach(len(drafts[i])))
                    for i, req in enumerate(reqs) if req is not None and req.grammar is not None])
    grammars = [(i, req.grammar) for i, req in enumerate(reqs) if req is not None and req.grammar is not None]
    start, flat, width = time.perf_counter(), bitmask.view(-1, bitmask.shape[-1]), bitmask.shape[1]
    for i, g in grammars:
        if not g.matcher.is_terminated():  # past its stop token (ignore_eos): nothing left to constrain
            g.matcher.fill_next_token_bitmask(flat, i * width)
    share = (time.perf_counter() - start) / max(1, len(grammars))
    for _, g in grammars:
        g.mask_s += share
        g.rounds += 1
    return False
