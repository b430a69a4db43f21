"""The target's logprobs on the cuda backend, with rounds in flight.

A round's raw logits live in its graph's output buffer, which the next launch overwrites, and
the host reads the round only later. So the launch reduces them on the device at once
(log_softmax, the chosen tokens' values, the top alternatives), starts their copy to the
host beside the round's packed result, and ``record`` files them on the request by absolute
position when the round is collected: the positions the round kept (accepted + 1 of them),
as draftline.core.logprobs.record does on the reference backend. Prefill does the same for the first
token and, for prompt_logprobs, for every prompt position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from draftline.core.logprobs import TokenLogprob
from draftline.core.request import Request


@dataclass(frozen=True)
class Pending:
    """Logprobs of some rows of a round on their way to the host."""

    reqs: tuple[Request, ...]
    rows: tuple[int, ...]  # each one's row in the round (its accepted count there); -1: keep every position
    first: Tensor  # [m] int64, the absolute position of each one's slot 0
    tokens: Tensor  # [m, T] int64, the tokens at slots 0 .. T-1
    chosen: Tensor  # [m, T] float32, their log-probabilities
    top_values: Tensor  # [m, T, k]
    top_ids: Tensor  # [m, T, k] int64

    def to_host(self) -> "Pending":
        """Copies started now (pinned, asynchronous on a GPU; on the CPU a clone, since a view
        of a persistent buffer, e.g. a prefill's prompt ids, is rewritten by the next launch);
        read after the round's event."""
        move = (lambda t: t.to("cpu", non_blocking=True) if t.is_cuda else t.clone())
        return Pending(self.reqs, self.rows, *(move(t) for t in (self.first, self.tokens, self.chosen,
                                                                  self.top_values, self.top_ids)))

    def record(self, accepted: list[int]) -> None:
        """File each request's entries (host tensors; ``accepted`` per row of the round)."""
        first, tokens, chosen = self.first.tolist(), self.tokens.tolist(), self.chosen.tolist()
        values, ids = self.top_values.tolist(), self.top_ids.tolist()
        for j, (req, row) in enumerate(zip(self.reqs, self.rows)):
            n = req.params.logprobs if row >= 0 else req.params.prompt_logprobs
            if n is None:  # a row of the round that reports nothing
                continue
            keep = len(tokens[j]) if row < 0 else accepted[row] + 1
            for t in range(keep):
                top = tuple(zip(ids[j][t][:n], values[j][t][:n]))
                req.logprobs[first[j] + t] = TokenLogprob(tokens[j][t], chosen[j][t], top)


def reduce(logits: Tensor, tokens: Tensor, top_n: int) -> tuple[Tensor, Tensor, Tensor]:
    """logits [m, T, V] (slot t's logits score tokens[:, t]) -> (chosen [m, T], top values and
    ids [m, T, top_n]), as draftline.core.logprobs.token_logprobs computes them."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, tokens.clamp(min=0)[..., None])[..., 0]
    if top_n > 0:
        top = logp.topk(top_n, dim=-1)
        return chosen, top.values, top.indices
    empty = logp.new_empty(*tokens.shape, 0)
    return chosen, empty, empty.long()


def window(reqs: list[Request], logits: Tensor, tokens: Tensor, first: Tensor) -> Pending | None:
    """A round's logprobs (logits [n, W, V], its tokens [n, W]: accepted drafts, then the
    correction or bonus, -1 past them; first [n]: slot 0's position), when any row reports
    them. Every row is reduced (picking rows would copy their indices to the device, which
    waits for the rounds in flight); ``record`` files only the rows that asked."""
    asked = [r.params.logprobs for r in reqs if r.params.logprobs is not None]
    if not asked:
        return None
    chosen, values, ids = reduce(logits, tokens, max(asked))
    return Pending(tuple(reqs), tuple(range(len(reqs))), first, tokens, chosen, values, ids)


def pending(reqs: list[Request], logits: Tensor, tokens: Tensor, first: Tensor) -> list[Pending]:
    """``window``'s logprobs as the list a landing takes: empty where no row reports them."""
    found = window(reqs, logits, tokens, first)
    return [] if found is None else [found]


def prompt(req: Request, hidden: Tensor, ids: Tensor, logits_of: Callable[[Tensor], Tensor],
           chunk: int = 1024) -> Pending:
    """A prompt's own logprobs: hidden [P - 1, H] at positions 0 .. P-2 scoring ids [P - 1] (the
    prompt's tokens 1 .. P-1), through the LM head ``chunk`` positions at a time (a long
    prompt's full logits would not fit)."""
    parts = [reduce(logits_of(hidden[a:a + chunk])[None], ids[None, a:a + chunk], req.params.prompt_logprobs)
             for a in range(0, ids.shape[0], chunk)]
    chosen, values, top = (torch.cat(p, dim=1) for p in zip(*parts))
    first = torch.ones(1, dtype=torch.int64, device=hidden.device)
    return Pending((req,), (-1,), first, ids[None], chosen, values, top)
