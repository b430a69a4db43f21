"""Logit adjustments before sampling, in plain torch: presence, frequency and repetition
penalties, logit_bias and min_new_tokens.

They apply at every verified position exactly as plain decoding applies them there: the
counts at draft slot j include the request's output so far and the drafts before slot j, so
that if those drafts are accepted, the distribution at slot j is the one plain decoding would
have sampled from. Greedy output with drafting therefore equals greedy output without it.
Conventions follow vLLM: presence and frequency count generated tokens only; repetition counts
prompt and generated tokens (positive logits divided by it, negative ones multiplied).

``adjust_window`` is the arithmetic, on one request's tensors; the reference backend builds
them from the request's token lists (``adjust_logits``), the cuda backend keeps them on the
device per slot (backends/cuda/penalties.py), so both compute the same values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .request import Request
from .sampling import SamplingParams


@dataclass(frozen=True)
class RowConstants:
    """What a request's adjustment reads that never changes while it runs (device tensors)."""

    bias_ids: Tensor | None  # [B] int64, logit_bias's ids (None: no bias)
    bias: Tensor | None  # [B] float32, their biases
    stop_mask: Tensor | None  # [V] bool, the ids min_new_tokens holds back (None: nothing to hold)

    @staticmethod
    def of(params: SamplingParams, stop_ids: frozenset[int], vocab: int) -> "RowConstants":
        """On the host; ``moved`` puts them where the logits are."""
        ids = torch.tensor([i for i, _ in params.logit_bias], dtype=torch.int64) if params.logit_bias else None
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32) if params.logit_bias else None
        mask = None
        if params.min_new_tokens and stop_ids:
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[torch.tensor(sorted(stop_ids))] = True
        return RowConstants(ids, bias, mask)

    def moved(self, to_device: Callable[[Tensor], Tensor]) -> "RowConstants":
        return RowConstants(*(None if t is None else to_device(t) for t in (self.bias_ids, self.bias, self.stop_mask)))


def adjust_window(x: Tensor, counts: Tensor, in_prompt: Tensor | None, made: Tensor, params: SamplingParams,
                  const: RowConstants, drafts: Tensor | None) -> Tensor:
    """One request's logits x [T, V] at window slots 0 .. T-1 -> adjusted (float32).
    counts [V]: its generated tokens so far; in_prompt [V] bool: its prompt's tokens (needed for
    repetition_penalty); made: 0-dim int64, tokens generated before slot 0; drafts [T-1]: the
    window's drafts (slot j also counts drafts 0 .. j-1)."""
    t, v = x.shape
    x = x.float()
    counts = counts.float().expand(t, v)  # [T, V] generated-token counts before each slot
    if drafts is not None and t > 1:
        seen = torch.nn.functional.one_hot(drafts[: t - 1], v).float().cumsum(0)  # [T-1, V]
        counts = torch.cat([counts[:1], counts[1:] + seen])
    if params.repetition_penalty != 1.0:
        seen_any = in_prompt[None] | (counts > 0)
        scaled = torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty)
        x = torch.where(seen_any, scaled, x)
    x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    if const.bias_ids is not None:
        x = x.index_add(1, const.bias_ids, const.bias.expand(t, -1))
    if const.stop_mask is not None:
        early = made + torch.arange(t, device=x.device) < params.min_new_tokens  # [T]
        x = x.masked_fill(early[:, None] & const.stop_mask[None], float("-inf"))
    return x


def adjust_logits(logits: Tensor, reqs: list[Request], drafts: Tensor | None) -> Tensor:
    """logits [N, T, V] at slots 0 .. T-1 (slot 0 follows each request's tokens so far, slot j
    also its first j drafts [N, T-1]) -> adjusted logits (a new tensor; rows whose requests
    adjust nothing are unchanged)."""
    if not any(r.params.adjusts_logits for r in reqs):
        return logits
    out = logits.float().clone()
    for i, req in enumerate(reqs):
        if req.params.adjusts_logits:
            out[i] = _adjust_row(out[i], req, None if drafts is None else drafts[i])
    return out


def _adjust_row(x: Tensor, req: Request, drafts: Tensor | None) -> Tensor:
    """x [T, V] for one request, its tensors built from its token lists; drafts [T-1] or None."""
    v, dev = x.shape[-1], x.device
    out_ids = torch.tensor(req.output_ids, dtype=torch.int64, device=dev)
    counts = torch.zeros(v, device=dev).index_add_(0, out_ids, torch.ones(len(out_ids), device=dev))
    in_prompt = None
    if req.params.repetition_penalty != 1.0:
        in_prompt = torch.zeros(v, dtype=torch.bool, device=dev)
        in_prompt[torch.tensor(req.prompt_ids, device=dev)] = True
    made = torch.tensor(len(req.output_ids), device=dev)
    const = RowConstants.of(req.params, req.stop_ids, v).moved(lambda t: t.to(dev))
    return adjust_window(x, counts, in_prompt, made, req.params, const, drafts)
