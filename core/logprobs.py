"""The target's log-probabilities of chosen tokens and their top alternatives.

Raw: log_softmax of the target's logits, before temperature, penalties or bias (what the
model says, the quantity loglikelihood harnesses sum). A backend records them by absolute
position on the request; a later verification of the same position replaces an earlier one,
so the positions a request keeps always hold the logprobs of the tokens it kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the n most likely tokens at this position, most likely first


def token_logprobs(logits: Tensor, tokens: Tensor, top_n: int) -> list[TokenLogprob]:
    """logits [T, V] (position t predicts tokens[t]), tokens [T] int64 -> one entry per position."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [T, V]
    chosen = logp.gather(-1, tokens[:, None])[:, 0].tolist()  # [T]
    if top_n > 0:
        values, ids = logp.topk(top_n, dim=-1)  # [T, n]
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(chosen)
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(tokens.tolist(), chosen, tops)]


def record(store: dict[int, TokenLogprob], first_position: int, logits: Tensor, tokens: Tensor, top_n: int) -> None:
    """Record tokens [T] at positions first_position .. + T - 1 from logits [T, V]."""
    for i, entry in enumerate(token_logprobs(logits, tokens, top_n)):
        store[first_position + i] = entry
