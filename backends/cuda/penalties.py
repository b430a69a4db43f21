"""Penalties, logit_bias and min_new_tokens on the cuda backend, with rounds in flight.

The host books a round only after rounds behind it were launched, so what a request has
generated lives on the device, by KV slot: ``counts`` [slots + 1, V] (each emitted token
counted when its round is decided, in stream order before any later round reads it) and
``in_prompt`` [slots + 1, V] (for repetition_penalty), both made at the first request that
adjusts logits. Each round's adjustment is draftline.core.penalties.adjust_window, the reference's own
arithmetic, over the verify window's raw logits with the window's drafts counted slot by slot;
the number generated before the window comes from the row's device start. Rounds whose rows
adjust nothing never come here (the launch keeps its graph-decided path for them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from draftline.core.penalties import RowConstants, adjust_window
from draftline.core.request import Request


class SlotPenalties:
    def __init__(self, num_slots: int, vocab: int, device: torch.device, to_device: Callable[[Tensor], Tensor]):
        self.num_slots, self.vocab, self.device, self.to_device = num_slots, vocab, device, to_device
        self.counts: Tensor | None = None  # [slots + 1, V] float32: generated tokens per slot
        self.in_prompt: Tensor | None = None  # [slots + 1, V] bool: prompt tokens per slot
        self.rows: dict[int, RowConstants] = {}  # slot -> its request's constants (set at admission)

    def _buffers(self) -> tuple[Tensor, Tensor]:
        if self.counts is None:
            shape = (self.num_slots + 1, self.vocab)
            self.counts = torch.zeros(shape, dtype=torch.float32, device=self.device)
            self.in_prompt = torch.zeros(shape, dtype=torch.bool, device=self.device)
        return self.counts, self.in_prompt

    def admit(self, reqs: list[Request]) -> None:
        """New requests in their slots: nothing generated yet, their prompts, their constants
        (host values copied without waiting for the rounds in flight)."""
        for req in reqs:
            if not req.params.adjusts_logits:
                continue
            counts, in_prompt = self._buffers()
            counts[req.kv].zero_()
            in_prompt[req.kv].zero_()
            if req.recomputed:  # resumed after a preemption: what it generated before counts
                made = self.to_device(torch.tensor(req.output_ids[: req.recomputed], dtype=torch.int64))
                counts[req.kv].index_add_(0, made, torch.ones(made.shape[0], device=self.device))
            if req.params.repetition_penalty != 1.0:
                in_prompt[req.kv, self.to_device(torch.tensor(req.prompt_ids, dtype=torch.int64))] = True
            self.rows[req.kv] = RowConstants.of(req.params, req.stop_ids, self.vocab).moved(self.to_device)

    def adjust(self, logits: Tensor, reqs: list[Request], start: Tensor, drafts: Tensor | None) -> Tensor:
        """logits [n, W, V] of a round (row i's slot 0 at position start[i] + 1), drafts [n, W - 1]
        -> adjusted logits (a new tensor; rows that adjust nothing as they were)."""
        if self.counts is None or not any(r.params.adjusts_logits for r in reqs):
            return logits
        out = logits.float().clone()
        for i, req in enumerate(reqs):
            if req.params.adjusts_logits:
                made = start[i] + 1 - len(req.prompt_ids)  # 0-dim, on the device: tokens generated before slot 0
                out[i] = adjust_window(logits[i], self.counts[req.kv], self.in_prompt[req.kv], made, req.params,
                                       self.rows[req.kv], None if drafts is None else drafts[i])
        return out

    def count(self, reqs: list[Request], tokens: Tensor, accepted: Tensor | None) -> None:
        """Count each adjusting row's emitted tokens: tokens [n, W] (the accepted drafts, then the
        correction or bonus; anything past them ignored), accepted [n] (None: one token each)."""
        if self.counts is None:
            return
        width = tokens.shape[1]
        for i, req in enumerate(reqs):
            if req.params.adjusts_logits:
                kept = torch.ones(width, device=tokens.device) if accepted is None else \
                    (torch.arange(width, device=tokens.device) <= accepted[i]).float()
                self.counts[req.kv].index_add_(0, tokens[i].clamp(min=0), kept)
