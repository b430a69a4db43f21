"""Logit adjustments before sampling, in plain torch: presence, frequency and repetition
penalties, logit_bias and min_new_tokens.

They apply at every verified position exactly as plain decoding applies them there: the
counts at draft slot j include the request's output so far and the drafts before slot j, so
that if those drafts are accepted, the distribution at slot j is the one plain decoding would
have sampled from. Greedy output with drafting therefore equals greedy output without it.
Conventions follow vLLM: presence and frequency count generated tokens only; repetition counts
prompt and generated tokens (positive logits divided by it, negative ones multiplied).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .request import Request


def adjust_logits(logits: Tensor, reqs: list[Request], drafts: Tensor | None) -> Tensor:
    """logits [N, T, V] at slots 0 .. T-1 (slot 0 follows each request's tokens so far, slot j
    also its first j drafts [N, T-1]) -> adjusted logits (a new tensor; rows whose requests
    adjust nothing are unchanged)."""
    if not any(r.params.adjusts_logits for r in reqs):
        return logits
    out = logits.float().clone()
    for i, req in enumerate(reqs):
        if req.params.adjusts_logits:
            row = None if drafts is None else drafts[i]
            out[i] = _adjust_row(out[i], req, row)
    return out


def _adjust_row(x: Tensor, req: Request, drafts: Tensor | None) -> Tensor:
    """x [T, V] for one request; drafts [T-1] or None."""
    p, (t, v) = req.params, x.shape
    dev = x.device
    out_ids = torch.tensor(req.output_ids, dtype=torch.int64, device=dev)
    counts = torch.zeros(v, device=dev).index_add_(0, out_ids, torch.ones(len(out_ids), device=dev))
    counts = counts.expand(t, v).clone()  # [T, V] generated-token counts before each slot
    if drafts is not None and t > 1:
        seen = torch.nn.functional.one_hot(drafts[: t - 1], v).float().cumsum(0)  # [T-1, V]
        counts[1:] += seen
    if p.repetition_penalty != 1.0:
        in_prompt = torch.zeros(v, dtype=torch.bool, device=dev)
        in_prompt[torch.tensor(req.prompt_ids, device=dev)] = True
        seen_any = in_prompt[None] | (counts > 0)
        scaled = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
        x = torch.where(seen_any, scaled, x)
    x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    if p.logit_bias:
        ids = torch.tensor([i for i, _ in p.logit_bias], device=dev)
        bias = torch.tensor([b for _, b in p.logit_bias], device=dev)
        x[:, ids] += bias
    if p.min_new_tokens and req.stop_ids:
        made = len(req.output_ids) + torch.arange(t, device=dev)  # [T] tokens generated before each slot
        early = made < p.min_new_tokens
        is_stop = torch.zeros(v, dtype=torch.bool, device=dev)
        is_stop[torch.tensor(sorted(req.stop_ids), device=dev)] = True
        x = x.masked_fill(early[:, None] & is_stop[None], float("-inf"))
    return x
