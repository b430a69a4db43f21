"""Constrained rounds (a grammar's masks): the part of a round that needs no mask runs ahead,
while the host books the round before it and fills the masks.

A constrained round's masks come from the grammar after every token before it (and, where it
drafts, after its drafts), so the host cannot launch it ahead as it does other rounds: the
machine collects each one before the next. What needs no mask, though, needs nothing from the
host either: a round's draft step and the target's verify forward start from the rows' state on
the device. So as soon as a constrained round is launched, the next round's unmasked part is
launched behind it for the same rows (``Ahead``): the device computes the next logits while the
host reads this round, advances the grammars and fills the next masks, and only the masking and
the decision (one small graph) wait for the host. The drafts come back in a copy of their own
right after the draft step, so the host reads them while the verify forward runs.

An ahead part is taken by the next launch at the same width of rows it computed: a request freed
since (ended, or preempted to come back under its id in other slots) leaves a padding row, which
reads the scratch slot, so the decision writes none of its state. A launch with a row it did not
compute runs its unmasked part anew, and another launch in between drops it (it gathers other
rows into the round buffers the part left: drafts, starts, seeds): at worst the device computed
one forward for nothing. A prefill between them writes only its own slots' state. Drafts the
grammar forbids are replaced by the drafter's best allowed token once the host has read them
(the draft step brings each slot's best CANDIDATES tokens back with its drafts, a small copy at
any vocabulary), and the verify forward runs again over the new drafts: the tokens after a
replaced slot are worth verifying. Drafts drawn from q take
the eager path, which chooses them under the grammar before its verify.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from draftline.core.walk import CANDIDATES, best_allowed
from draftline.core.request import Request

from . import events
from . import sampling as kernels
from .buffers import INV_TEMP, SEED, START
from .landing import Launch
from .masks import TokenMasks, apply_masks

if TYPE_CHECKING:
    from .backend import CudaBackend


@dataclass(frozen=True)
class Ahead:
    """A round's unmasked part, launched before its masks exist."""

    lanes: tuple  # [bucket] the request id each row of its round computes (None: padding, or a request since freed)
    width: int
    logits: Tensor  # [bucket, W, V] float32: its verify forward's
    started: torch.cuda.Event | None  # recorded before its first device work (the round's device time)

    def rows_of(self, reqs: list[Request], width: int) -> list[int] | None:
        """Each request's row in this round, or None where the launch cannot take it (another
        width, or a request it did not compute)."""
        where = {rid: i for i, rid in enumerate(self.lanes) if rid is not None}
        rows = [where.get(r.rid) for r in reqs]
        return None if width != self.width or None in rows else rows


class ConstrainedRounds:
    def __init__(self, backend: "CudaBackend"):
        self.backend = backend
        b = backend.bufs
        self.masks = TokenMasks(b.max_batch, backend.width, backend.target.config.vocab_size, backend.device)
        pinned = backend.device.type == "cuda"
        self._drafts = torch.zeros(b.drafts.numel(), dtype=torch.int64, pin_memory=pinned)  # [max_batch * K] on the host
        k, m = backend.width - 1, min(CANDIDATES, backend.target.config.vocab_size)
        self.ranked = torch.zeros(b.max_batch, k, m, dtype=torch.int32, device=backend.device)  # [max_batch, K, M]
        self._ranked = torch.zeros(self.ranked.shape, dtype=torch.int32, pin_memory=pinned)  # its copy on the host
        self._drafted = torch.cuda.Event() if pinned else None  # the last draft copy has landed
        self.ahead: Ahead | None = None

    def drop(self) -> None:
        """Something else runs next: the ahead part's buffers are no longer its own."""
        self.ahead = None

    def release(self, req: Request) -> None:
        """A freed request's row of the ahead part becomes padding: the others' rows still hold
        their next round (a preempted request comes back under its id, in other slots)."""
        if self.ahead is not None and req.rid in self.ahead.lanes:
            self.ahead = replace(self.ahead, lanes=tuple(None if rid == req.rid else rid for rid in self.ahead.lanes))

    def launch(self, reqs: list[Request], bucket: int, width: int, then: int) -> Launch:
        """A constrained round of ``width`` (greedy drafts, decided on the device): its unmasked
        part (run ahead by the last launch, or now), its masks, the masked decision; then the
        next round's unmasked part for the same rows, at the width ``then`` the machine chose
        for it (a switch of width wastes no forward). The ahead part is taken by any of the
        rows it computed: those that ended since are padding rows of the round."""
        ahead, self.ahead = self.ahead, None
        rows = None if ahead is None else ahead.rows_of(reqs, width)
        fresh = rows is None
        rows = list(range(len(reqs))) if fresh else rows
        lanes: list[Request | None] = [None] * (bucket if fresh else len(ahead.lanes))
        for i, req in zip(rows, reqs):
            lanes[i] = req
        bucket, ids = len(lanes), tuple(None if r is None else r.rid for r in lanes)
        self.backend.bufs.load(lanes, bucket)  # rows of requests freed since read the scratch slot: nothing written
        if fresh:
            ahead = self._unmasked(ids, width)
        drafts = self._host_drafts(bucket, width)
        moved, stale = self.masks.load(lanes, drafts, bucket, width, self._choosers(lanes, drafts))  # after the choices
        if moved:
            self._put_drafts(drafts)
        logits = self._reverified(ahead) if stale else ahead.logits
        packed = self.backend.graphs.run(("decide", bucket, width), lambda: self._decide(bucket, width, logits))
        if rows != list(range(len(reqs))):  # the requests' rows, in their order
            packed = packed.index_select(0, self.backend.staging.put(np.array(rows, dtype=np.int64)))
        handle = self.backend.landing.land(packed[: len(reqs)], width, [], ahead.started)
        self.ahead = self._unmasked(ids, then)
        return handle

    def capture(self, bucket: int) -> None:
        """Start-up: each width's unmasked part and decision, over padding rows."""
        for width in sorted({1, self.backend.width}):
            logits = self._unmasked((None,) * bucket, width).logits
            self.backend.graphs.run(("decide", bucket, width), lambda: self._decide(bucket, width, logits))
        self.drop()

    def _unmasked(self, lanes: tuple, width: int) -> Ahead:
        """Launch the draft step (its drafts copied back behind it) and the verify forward."""
        bucket, backend = len(lanes), self.backend
        started = backend.landing.started()
        if width > 1:
            ranked = self.ranked[:bucket]
            backend.graphs.run(("draft", bucket, width), lambda: backend._draft_round(bucket, width, ranked))
            drafts = backend.bufs.drafts[:bucket]  # [bucket, K]: a constrained round drafts its full window
            self._drafts[: drafts.numel()].view_as(drafts).copy_(drafts, non_blocking=self._drafted is not None)
            self._ranked[:bucket].copy_(ranked, non_blocking=self._drafted is not None)
            if self._drafted is not None:
                events.record(self._drafted, backend.landing.device_index)
        logits, _ = backend._replay(bucket, width, False, False)
        return Ahead(lanes, width, logits, started)

    def _host_drafts(self, bucket: int, width: int) -> list[list[int]] | None:
        """The round's drafts, a list a row, once their copy has landed (a plain round has none)."""
        if width == 1:
            return None
        if self._drafted is not None:
            self._drafted.synchronize()
        return self._drafts[: bucket * (width - 1)].view(bucket, width - 1).tolist()

    def _choosers(self, lanes: list[Request | None], drafts: list[list[int]] | None) -> list | None:
        """How each constrained row's drafts are chosen under its grammar: the drafter's best
        allowed token among its candidates (core.walk.best_allowed)."""
        if drafts is None:
            return None
        host = self._ranked.numpy()
        return [best_allowed(d, host[i]) for i, d in enumerate(drafts)]

    def _put_drafts(self, drafts: list[list[int]]) -> None:
        """The drafts the masks' walk chose (a forbidden draft replaced, or cut at its row's
        reach: Matcher.fill_window) onto the device, where the decision reads them: a constrained
        round drafts the full window, so its rows lead the buffer and one copy lands them."""
        self.backend.staging.put_into(self.backend.bufs.drafts.view(-1), np.array(drafts, dtype=np.int64).ravel())

    def _reverified(self, ahead: Ahead) -> Tensor:
        """The verify logits over the chosen drafts, where one changed before its row's cut: the
        verify forward runs again, a graph's into the same logits; the tokens after a replaced
        slot are worth verifying."""
        return self.backend._replay(len(ahead.lanes), ahead.width, False, False)[0]

    def _decide(self, bucket: int, width: int, logits: Tensor) -> Tensor:
        """The round decided over its verify logits masked by each constrained row's grammar
        (all allowed elsewhere) -> packed [bucket, 2W + 1]; a row fails on non-finite raw
        logits, not on the -inf its mask writes."""
        b = self.backend.bufs
        bad = kernels.nonfinite(logits)  # the raw logits', before the masks
        apply_masks(logits, self.masks.view(bucket, width))  # in place: a forward is decided once
        num, tokens = kernels.accept_matching(logits, b.drafts[:bucket, : width - 1], b.row(SEED, bucket),
                                              b.row(START, bucket), inv_temp=b.fmeta[INV_TEMP, :bucket], shift=1)
        return self.backend._settle(bucket, width, num, tokens, bad, 1, 1, False)
