"""A grammar's walk through a round's drafts: each verify slot's mask after the drafts before
it, and the drafts chosen again under those masks.

A draft the grammar forbids would end its round's run there, and a drafter that never saw the
grammar proposes many (a JSON key spelled as the target spells it under the mask is rarely the
drafter's unmasked argmax). So each constrained row's drafts are chosen under the masks as the
walk goes: a forbidden draft becomes the drafter's best token the grammar allows there, read
off the drafter's ranking at that slot (its CANDIDATES best tokens, ``candidates``), the masked
argmax the target takes wherever the drafter ranks an allowed token that high; drafts drawn
from q are drawn again from q under the mask. Any such choice is lossless: a draft is any token
the acceptance rule weighs by the q it was drawn from.

A batch's rows walk in lockstep: slot j's masks for every row still walking are filled in one
call (xgrammar's batch matcher) and its drafts accepted in another, so a wide round pays the
Python side of a call once a slot rather than once a row and slot.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch
from torch import Tensor

CANDIDATES = 64  # a slot's best drafter tokens a forbidden draft is replaced from (32 miss the allowed one often)
LOOK = 32  # candidates checked at a time: most replacements are among the first
Chooser = Callable[[int, np.ndarray], "int | None"]  # (slot, its mask row) -> the slot's draft instead, or None


def walk(matchers: list, bitmask: Tensor, bases: list[int], drafts: list, chooses: list, reaches: list,
         last: int) -> list[list[int]]:
    """Each row's window walked, the rows in lockstep: row r's slot j mask into bitmask[bases[r]
    + j] (a host int32 tensor [rows, ceil(V / 32)], all allowed on entry) after its drafts
    0 .. j-1, slots 0 .. ``last``; chosen in place by ``chooses[r]`` (Matcher.fill_window), cut
    at ``reaches[r]``; each matcher walks its drafts and rolls back -> each row's changed slots."""
    start, words, n = time.perf_counter(), bitmask.numpy(), len(matchers)
    xs, batch = [m.matcher for m in matchers], matchers[0].batch
    walked, changed, live = [0] * n, [[] for _ in range(n)], list(range(n))
    for m, d in zip(matchers, drafts):
        m._drafted = d is not None
    for j in range(last + 1):
        live = [r for r in live if not xs[r].is_terminated()]  # past its stop token (ignore_eos): nothing to constrain
        if not live:
            break
        if len(live) == 1:  # one call a slot either way
            xs[live[0]].fill_next_token_bitmask(bitmask, bases[live[0]] + j)
        else:
            batch.batch_fill_next_token_bitmask([xs[r] for r in live], bitmask, [bases[r] + j for r in live])
        if j == last:
            break
        going = [r for r in live if (chooses[r] is None and j != reaches[r])
                 or _choose(matchers[r], words[bases[r] + j], drafts[r], j, chooses[r], reaches[r], changed[r])]
        if len(going) == 1:
            kept = [xs[going[0]].accept_token(drafts[going[0]][j])]
        else:
            kept = batch.batch_accept_token([xs[r] for r in going], [drafts[r][j] for r in going]) if going else []
        live = [r for r, ok in zip(going, kept) if ok]
        for r, ok in zip(going, kept):
            walked[r] += ok
            matchers[r].refused += not ok
    for x, steps in zip(xs, walked):
        if steps:
            x.rollback(steps)
    share = (time.perf_counter() - start) / max(1, n)
    for m in matchers:
        m.mask_s += share
        m.rounds += 1
    return changed


def _choose(m, row: np.ndarray, drafts: list[int], j: int, choose: Chooser | None, reach: int | None,
            changed: list[int]) -> bool:
    """Slot j's draft chosen under its mask row (in place, its slot added to ``changed`` if it
    changed) -> whether the row walks on past it (not where its reach cuts the walk)."""
    if j == reach and (cut := _forbidden(row, m.vocab_size)) is not None:
        drafts[j] = cut
        changed.append(j)
        return False
    new = None if choose is None else choose(j, row)
    if new is not None and new != drafts[j]:
        m.replaced += not _allows(row, drafts[j])
        drafts[j] = new
        changed.append(j)
    return True


def fill_masks(reqs, drafts: list[list[int]] | None, bitmask: Tensor,
               choosers: list | None = None) -> tuple[bool, bool]:
    """bitmask [>= N, W, ceil(V / 32)] int32 on the host: each constrained request's slot masks
    (after its drafts, chosen in place by ``choosers[i]`` where given, each walked only as far
    as its Matcher.reach), every other row (and a None one: padding) all allowed -> (whether any
    draft changed, whether any changed before its row's cut: a verify forward over the drafts
    as they were no longer holds there; one changed only at its cut is rejected at that slot,
    whose logits read only the drafts before it). The rows walk together (``walk``); a plain
    round (no drafts) fills slot 0."""
    bitmask.fill_(-1)
    rows = [i for i, req in enumerate(reqs) if req is not None and req.grammar is not None]
    if not rows:
        return False, False
    width, matchers = bitmask.shape[1], [reqs[i].grammar for i in rows]
    own = [None] * len(rows) if drafts is None else [drafts[i] for i in rows]
    chooses = [None] * len(rows) if choosers is None else [choosers[i] for i in rows]
    reaches = [None if d is None else m.reach(len(d)) for m, d in zip(matchers, own)]
    flat = bitmask.view(-1, bitmask.shape[-1])
    changed = walk(matchers, flat, [i * width for i in rows], own, chooses, reaches, 0 if drafts is None else width - 1)
    # at its reach a slot changes only by the cut (a mask that forbids nothing leaves no token to replace)
    return any(changed), any(j != reach for slots, reach in zip(changed, reaches) for j in slots)


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
