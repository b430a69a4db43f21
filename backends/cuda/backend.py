"""The cuda backend: static KV, persistent buffers, graph-captured draft and verify steps.

A round for a bucket of rows: load the rows' facts into the buffers (one copy), replay the
draft graph (graph-safe drafters drafting greedily), replay the verify graph (target forward
over [last token, drafts], the drafter's context update for every verified position), then
the acceptance kernel and one copy back. Prefill runs eagerly, one request at a time.
Without a GPU the same code runs eagerly through the Triton interpreter (TRITON_INTERPRET=1),
which is how CI holds it to the reference backend.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor

from backends.base import Capacity, DraftRows, Proposal, Verification
from core.machine import Plan
from core.methods.base import Drafter, Method
from core.models.target import TargetModel
from core.request import Request
from core.sampling import SamplingBatch, Stream, Verdict, probs_from_logits

from . import overlap
from . import sampling as kernels
from .buffers import DRAFT_SLOT, INV_TEMP, LAST, SEED, SLOT, START, Buffers, FeatureRing, inverse_temperature, rows_key
from .fused import head_argmax, head_draw, lm_logits
from .graphs import Graphs
from .kv import FrozenTargetKV, Rows, RowsAttention, StaticKV, StaticStore
from .matvec import Draw, take_draws
from .windows import block_window, verify_window


@triton.jit
def _settle_kernel(meta, drafts, num, tokens, bad, packed, nxt, stride_meta, stride_next, K, W, scratch,
                   LAST_ROW: tl.constexpr, START_ROW: tl.constexpr, SLOT_ROW: tl.constexpr, REAL: tl.constexpr,
                   CHUNKS: tl.constexpr, BLOCK: tl.constexpr, DRAWN: tl.constexpr):
    """Row n of a decided round: packed [finite, accepted, tokens (W), drafts (W - 1)] for the
    host (finite: none of its W draws counted a non-finite logit), and the row's next last
    token and start into ``nxt`` (padding rows keep theirs). ``num``, ``tokens`` and ``bad``
    [rows, CHUNKS] are accept_matching's; with DRAWN, ``tokens`` and ``bad`` are the scratch the
    head's matvec_draw left its draws in (taken here), and the acceptance is made here: drafts
    are accepted while they match the draws."""
    n = tl.program_id(0)
    t = tl.arange(0, BLOCK)
    drafted = tl.load(drafts + n * K + t, mask=t < W - 1, other=0)
    if DRAWN:
        drawn, counts = take_draws(tokens, bad, n * W + t, t < W)
        count = tl.sum(tl.where(t < W, counts, 0), axis=0)
        accepted = tl.min(tl.where((t >= W - 1) | (drawn != drafted), t, BLOCK), axis=0).to(tl.int64)
        last = tl.sum(tl.where(t == accepted, drawn, 0), axis=0)
        drawn = tl.where(t <= accepted, drawn, -1)  # -1 past the emitted token, as accept_matching leaves it
    else:
        c = tl.arange(0, CHUNKS)
        counts = tl.load(bad + (n * W + t[:, None]) * CHUNKS + c[None, :],
                         mask=(t[:, None] < W) & (c[None, :] < REAL), other=0)  # [BLOCK, CHUNKS] in one load
        count = tl.sum(tl.sum(counts, axis=1), axis=0)
        accepted = tl.load(num + n)
        drawn = tl.load(tokens + n * W + t, mask=t < W, other=-1)
        last = tl.load(tokens + n * W + accepted)
    out = packed + n * (2 * W + 1)
    tl.store(out, (count == 0).to(tl.int64))
    tl.store(out + 1, accepted)
    tl.store(out + 2 + t, drawn, mask=t < W)
    tl.store(out + 2 + W + t, drafted, mask=t < W - 1)
    live = tl.load(meta + SLOT_ROW * stride_meta + n) != scratch
    last = tl.where(live, last, tl.load(meta + LAST_ROW * stride_meta + n))
    tl.store(nxt + n, last)
    tl.store(nxt + stride_next + n, tl.load(meta + START_ROW * stride_meta + n) + tl.where(live, accepted + 1, 0))


@dataclass(frozen=True)
class Flight:
    """A round launched before the host booked the one before it, and where its results land."""

    rids: tuple[int, ...]  # the rows it runs, in order
    bucket: int
    width: int
    lens: tuple[int, ...] | None  # the rows' lengths it runs at, once the host knows them
    logits: Tensor  # [bucket, W, V] graph output (a later launch may overwrite it)
    features: Tensor | None
    host: Tensor  # [bucket, 2 + W + K] pinned: finite, accepted, tokens, drafts
    copied: torch.cuda.Event | None  # set once host holds them (None: the copy was synchronous)

    def serves(self, reqs: list[Request], bucket: int, width: int) -> bool:
        return self.lens is not None and (rows_key(reqs), bucket, width) == \
            (tuple(zip(self.rids, self.lens)), self.bucket, self.width)

    def wait(self) -> Tensor:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host


def buckets_for(max_batch: int) -> list[int]:
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class CudaBackend:
    name = "cuda"

    def __init__(self, target: TargetModel, method: Method, plan: Plan, device: torch.device, dtype: torch.dtype,
                 capacity: Capacity):
        cfg, width = target.config, plan.num_speculative_tokens + 1
        self.target, self.plan, self.device, self.width = target, plan, device, width
        margin = max(width, plan.block_size or 0)  # draft and verify windows may run past max_model_len
        self.cache = StaticKV(cfg.num_layers, capacity.max_batch, cfg.num_kv_heads, capacity.max_model_len + margin,
                              cfg.head_dim, dtype, device)
        self.kv = StaticStore(capacity.max_batch, capacity.max_model_len + margin, device)
        self.drafter: Drafter | None = method.build_drafter(plan, target, self.kv, device, dtype)
        self.bufs = Buffers(capacity.max_batch, plan.num_speculative_tokens, self.cache.scratch, device)
        self.ring: FeatureRing | None = None  # the last verified features, for drafters that read them
        if self.drafter is not None and self.drafter.reads_last_features:
            taps = len(plan.target_layer_ids) * cfg.hidden_size
            self.ring = FeatureRing(capacity.max_batch, 2 * width + 1, taps, dtype, device)  # two rounds ahead
        self.graphs = Graphs(enabled=device.type == "cuda" and capacity.graphs)
        self.branch = overlap.Branch(device)  # the drafter's context update, beside the verify step's LM head
        self.buckets = buckets_for(capacity.max_batch)
        self._decided: tuple[tuple, Tensor] | None = None  # the round verify() already decided
        self._flights: deque[Flight] = deque()  # rounds launched ahead, oldest first (at most two)
        self._proposed: Proposal | None = None  # the drafts draft() handed out from the oldest flight
        self._landing: dict[torch.Size, deque[Tensor]] = {}  # pinned buffers for flights' results, rotated
        self.timeline: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None  # set: flights' GPU spans
        self.rounds_ahead = 0  # rounds served by a run-ahead launch

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    # ------------------------------------------------------------------ prefill

    @torch.inference_mode()
    def prefill(self, reqs: list[Request]) -> list[int | None]:
        last = []
        for req in reqs:
            req.kv = self.cache.allocate()
            ids = torch.tensor([req.prompt_ids], device=self.device)  # [1, P]
            positions = torch.arange(ids.shape[1], device=self.device)[None]  # [1, P]
            hidden, features = self.target(ids, positions, self.cache.prefill_attention(req.kv),
                                           self.plan.target_layer_ids)
            last.append(self.target.logits(hidden[0, -1]))
            if self.ring is not None:
                self.ring.write(torch.tensor([req.kv], device=self.device), positions[:, -1], features[:, -1:])
            if self.drafter is not None:
                self.drafter.extend(req, None if features is None else features[0], 0)
        logits = torch.stack(last)  # [N, V]
        finite = torch.isfinite(logits).all(dim=1)
        at = torch.tensor([len(r.prompt_ids) for r in reqs], device=self.device)
        tokens = self._sample(torch.nan_to_num(logits), reqs, at)
        return [t if ok else None for t, ok in zip(tokens.tolist(), finite.tolist())]

    def _sample(self, logits: Tensor, reqs: list[Request], at: Tensor) -> Tensor:
        batch = SamplingBatch.of([r.params for r in reqs], self.device)
        scores, inv_temp = _scores(logits, reqs, batch)
        return kernels.sample(scores, batch.seed, at, Stream.SAMPLE, inv_temp=inv_temp)

    # ------------------------------------------------------------------ draft

    def skip_draft(self, reqs: list[Request]) -> Proposal:
        return Proposal(tokens=torch.empty(len(reqs), 0, dtype=torch.long, device=self.device))

    def _rows(self, bucket: int) -> DraftRows:
        b = self.bufs
        slots, start = b.row(SLOT, bucket), b.row(START, bucket)
        return DraftRows(last_token=b.row(LAST, bucket), start=start, batch=b.sampling(bucket),
                         caches=Rows(b.row(DRAFT_SLOT, bucket), start),
                         target_kv=FrozenTargetKV(self.cache, slots, start),
                         features=None if self.ring is None else self.ring.read(slots, start - 1),
                         head_argmax=functools.partial(head_argmax, scratch=b.argmax), block_window=block_window)

    @torch.inference_mode()
    def draft(self, reqs: list[Request]) -> Proposal:
        if self.drafter is None:
            return self.skip_draft(reqs)
        n, bucket = len(reqs), self.bucket(len(reqs))
        if self._flights and self._flights[0].serves(reqs, bucket, self.width):  # drafted by a round in flight
            self._proposed = Proposal(tokens=self._flights[0].wait()[:n, 2 + self.width :].clone())
            return self._proposed
        self._flights.clear()
        self.bufs.load(reqs, bucket)
        if self.drafter.graph_safe and self.plan.draft_sample_method == "greedy":
            tokens = self.graphs.run(("draft", bucket), lambda: self._draft_step(bucket))
            return Proposal(tokens=tokens[:n])
        proposal = self.drafter.propose(reqs, self._rows(bucket))
        return proposal.rows(list(range(n)))

    def _draft_step(self, bucket: int) -> Tensor:
        tokens = self.drafter.propose([], self._rows(bucket)).tokens  # [bucket, K]
        self.bufs.drafts[:bucket].copy_(tokens)
        return self.bufs.drafts[:bucket]

    # ------------------------------------------------------------------ verify

    @torch.inference_mode()
    def verify(self, reqs: list[Request], proposal: Proposal) -> Verification:
        """With argmax drafts and no top-k/top-p the graph also decides the round (acceptance
        kernel, finiteness): the host then copies one small tensor back and accept() is free.
        Such a round's logits and features are graph outputs that a round launched after it
        may already have overwritten: nothing reads them once the round is decided (a round
        with a non-finite row, whose other rows accept() decides again, is run afresh)."""
        n, bucket, width = len(reqs), self.bucket(len(reqs)), proposal.tokens.shape[1] + 1
        decide = proposal.probs is None and not _filtered(reqs)
        flight = self._flights[0] if self._flights else None
        if decide and flight is not None and flight.serves(reqs, bucket, width) and \
                (width == 1 or proposal is self._proposed):
            host = flight.wait()[:n, : 2 + width].clone()  # the landing buffer is reused
            if bool(host[:, 0].all()):
                self._flights.popleft()
                self.rounds_ahead += 1
                return self._verdict(reqs, host, flight.logits, flight.features)
        self._flights.clear()
        self.bufs.load(reqs, bucket)
        if width > 1 and proposal.tokens.data_ptr() != self.bufs.drafts.data_ptr():
            self.bufs.drafts[:n, : width - 1].copy_(proposal.tokens)
        logits, features, packed = self.graphs.run(("verify", width, bucket, decide),
                                                   lambda: self._verify_step(bucket, width, decide))
        if packed is None:
            return Verification(logits=logits[:n], features=None if features is None else features[:n])
        return self._verdict(reqs, packed[:n, : 2 + width].cpu(), logits, features)  # the round's one copy back

    def _verdict(self, reqs: list[Request], host: Tensor, logits: Tensor, features: Tensor | None) -> Verification:
        """host [n, 2 + W] from a deciding verify graph: finite, accepted, tokens."""
        n = len(reqs)
        self._decided = (rows_key(reqs), host[:, 1:])
        return Verification(logits=logits[:n], features=None if features is None else features[:n],
                            finite=host[:, 0].bool())

    def _verify_step(self, bucket: int, width: int, decide: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
        b = self.bufs
        ids, positions = verify_window(b.meta, b.drafts, bucket, width, LAST, START)  # [bucket, W] each
        started = False

        def extend(features: Tensor) -> None:  # [bucket, W, taps*H], once the last tapped layer is done
            nonlocal started
            if self.drafter is not None and self.drafter.graph_safe and not started:
                started = True  # beside the layers after the last tap and the LM head: only the next round
                with self.branch.fork():  # reads the drafter's cache; ring row start - 1 is not written below
                    self.drafter.extend_rows(self._rows(bucket), features, ids)

        attn = RowsAttention(self.cache, Rows(b.row(SLOT, bucket), b.row(START, bucket)), causal=True, tapped=extend)
        hidden, features = self.target(ids, positions, attn, self.plan.target_layer_ids)  # fused: attn.decoder_stack
        if features is not None:
            extend(features)  # a stack that did not call it (unfused) has no earlier point
        if self.ring is not None:
            self.ring.write(b.row(SLOT, bucket), b.row(START, bucket), features)
        logits = None
        if decide:  # the head folds the round's draws where it can (into b.argmax; the settle takes them)
            draw = Draw(b.row(SEED, bucket), b.row(START, bucket), b.fmeta[INV_TEMP, :bucket], width, shift=1)
            logits = head_draw(self.target.lm_head, hidden, b.argmax, draw)
        drawn = logits is not None
        if not drawn:
            logits = lm_logits(self.target.lm_head, hidden)  # [bucket, W, V] float32, as target.logits
        packed = self._settle(bucket, width, logits, drawn) if decide else None
        self.branch.join()
        return logits, features, packed

    def _settle(self, bucket: int, width: int, logits: Tensor, drawn: bool) -> Tensor:
        """Decide the round on the device -> packed [bucket, 2W + 1] for the one copy back; each
        live row's last token and start after it go to ``bufs.next``, so the next round can be
        launched before the host has read this one. With ``drawn`` the head folded the draws
        into ``bufs.argmax`` (head_draw); otherwise they are made here from the logits."""
        b = self.bufs
        real = chunks = 1
        if drawn:
            num, tokens, bad = b.argmax.best, b.argmax.best, b.argmax.bad  # num: not read
        else:
            _, real, chunks = kernels.chunking(logits.shape[-1])
            bad = torch.empty(bucket * width, chunks, dtype=torch.int32, device=self.device)  # [bucket * W, chunks]
            num, tokens = kernels.accept_matching(logits, b.drafts[:bucket, : width - 1], b.row(SEED, bucket),
                                                  b.row(START, bucket), inv_temp=b.fmeta[INV_TEMP, :bucket],
                                                  bad=bad, shift=1)
        packed = torch.empty(bucket, 2 * width + 1, dtype=torch.int64, device=self.device)
        _settle_kernel[(bucket,)](b.meta, b.drafts, num, tokens, bad, packed, b.next, b.meta.stride(0),
                                  b.next.stride(0), b.drafts.shape[1], width, self.cache.scratch, LAST_ROW=LAST,
                                  START_ROW=START, SLOT_ROW=SLOT, REAL=real, CHUNKS=chunks,
                                  BLOCK=triton.next_power_of_2(width), DRAWN=drawn)
        return packed

    # ------------------------------------------------------------------ accept

    @torch.inference_mode()
    def accept(self, reqs: list[Request], proposal: Proposal, verification: Verification) -> Verdict:
        decided, self._decided = self._decided, None
        used = decided is not None and decided[0] == rows_key(reqs)
        out = decided[1] if used else self._accept(reqs, proposal, verification)
        if self.drafter is not None and not self.drafter.graph_safe:
            for i, req in enumerate(reqs):
                feats = None if verification.features is None else verification.features[i, : int(out[i, 0]) + 1]
                self.drafter.extend(req, feats, req.seq_len - 1)
        if used and (self.drafter is None or self.drafter.graph_safe):
            self._run_ahead(reqs, out, proposal.tokens.shape[1] + 1)
        else:
            self._flights.clear()
        return Verdict(num_accepted=out[:, 0], tokens=out[:, 1:])

    def _run_ahead(self, reqs: list[Request], out: Tensor, width: int) -> None:
        """Keep two rounds in flight for the same rows, so the GPU does not idle through the
        host's bookkeeping. Each decided verify graph leaves the rows' next last token and start
        on the device, and a launch starts from them, so the round after next can be launched
        before the host has read the next. The host learns a flight's lengths one round later; a flight is
        used only if the next round asks for exactly its rows, lengths and width, otherwise it
        is dropped (what it wrote lies past each row's length, in slots later work overwrites
        in stream order, or in a feature ring deep enough for two rounds). Rows that this
        round finishes stop it; the second flight waits while the next round may end a row by
        length (its work would be thrown away, and its cache writes could pass the margin)."""
        lens, room = [], True
        for req, row in zip(reqs, out.tolist()):
            emitted = row[1 : row[0] + 2]
            if req.cancelled or req.finishes_with(emitted):
                self._flights.clear()
                return
            lens.append(req.seq_len + len(emitted))
            room = room and not req.finishes_with(emitted + [-1] * width)  # the next round cannot end it by length
        rids, bucket = tuple(r.rid for r in reqs), self.bucket(len(reqs))
        if not self._flights:  # this round ran afresh: the device holds its rows as they now stand
            self._flights.append(self._launch(rids, bucket, width, tuple(lens)))
        elif (self._flights[0].rids, self._flights[0].bucket, self._flights[0].width) == (rids, bucket, width):
            self._flights[0] = replace(self._flights[0], lens=tuple(lens))  # launched a round ago: lengths known now
        else:  # not ours (cannot happen: flights are this round's successors); the device rows are past use
            self._flights.clear()
            return
        if len(self._flights) == 1 and room:
            self._flights.append(self._launch(rids, bucket, width, None))

    def _launch(self, rids: tuple[int, ...], bucket: int, width: int, lens: tuple[int, ...] | None) -> Flight:
        """Replay the round's graphs from the rows as the last verify left them on the device.
        With a ``timeline`` list, events around the flight's work on the stream go into it."""
        span = None
        if self.timeline is not None:
            span = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            span[0].record()
        self.bufs.step_on(bucket)
        if width > 1:
            self.graphs.run(("draft", bucket), lambda: self._draft_step(bucket))
        logits, features, packed = self.graphs.run(("verify", width, bucket, True),
                                                   lambda: self._verify_step(bucket, width, True))
        pinned = self.device.type == "cuda"
        ring = self._landing.get(packed.shape)
        if ring is None:  # three: two flights, and the one the host is reading
            ring = self._landing[packed.shape] = deque(
                torch.empty(packed.shape, dtype=packed.dtype, pin_memory=pinned) for _ in range(3))
        host = ring[0]
        ring.rotate(-1)
        host.copy_(packed, non_blocking=pinned)
        if span is not None:
            span[1].record()
            self.timeline.append(span)
        copied = None
        if pinned:
            copied = torch.cuda.Event()
            copied.record()
        return Flight(rids, bucket, width, lens, logits, features, host, copied)

    def _accept(self, reqs: list[Request], proposal: Proposal, verification: Verification) -> Tensor:
        """Eager acceptance (drafts from q, top-k/top-p, or rows dropped after verify)."""
        n = len(reqs)
        self.bufs.load(reqs, self.bucket(n))  # a no-op unless verify dropped rows
        batch = self.bufs.sampling(n)
        first = self.bufs.row(START, n) + 1  # position of the first draft
        logits, drafts = verification.logits, proposal.tokens
        if proposal.probs is not None:
            p = probs_from_logits(logits, batch)
            num, tokens = kernels.accept_rejection(p, proposal.probs, drafts, batch.seed, first)
        else:
            scores, inv_temp = _scores(logits, reqs, batch)
            num, tokens = kernels.accept_matching(scores, drafts, batch.seed, first, inv_temp=inv_temp)
        return torch.cat([num[:, None], tokens], dim=1).cpu()  # [n, 1 + W]

    def free(self, req: Request) -> None:
        if req.kv is not None:
            self.cache.release(req.kv)
            req.kv = None
        if self.drafter is not None:
            if req.draft_state is not None and hasattr(req.draft_state, "index"):
                self.kv.release(req.draft_state)
            self.drafter.release(req)


def _filtered(reqs: list[Request]) -> bool:
    """Rows with top-k or top-p need the full probability pass; the rest sample from logits."""
    return any(r.params.top_k > 0 or r.params.top_p < 1 for r in reqs)


def _scores(logits: Tensor, reqs: list[Request], batch: SamplingBatch) -> tuple[Tensor, Tensor | None]:
    """What the sampling kernels draw from: log-probabilities after top-k/top-p when any row
    filters (inv_temp None), else the raw logits and each row's inverse temperature."""
    if _filtered(reqs):
        return torch.log(probs_from_logits(logits, batch)), None
    return logits, inverse_temperature(batch.temperature)
