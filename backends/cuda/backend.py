"""The cuda backend: static KV, persistent buffers, graph-captured draft and verify steps.

A round for a bucket of rows: load the rows' facts into the buffers (one copy), replay the
draft graph (graph-safe drafters drafting greedily), replay the verify graph (target forward
over [last token, drafts], the drafter's context update for every verified position), then
the acceptance kernel and one copy back. Prefill runs eagerly, one request at a time.
Without a GPU the same code runs eagerly through the Triton interpreter (TRITON_INTERPRET=1),
which is how CI holds it to the reference backend.
"""

from __future__ import annotations

from dataclasses import dataclass

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

from . import sampling as kernels
from .buffers import DRAFT_SLOT, LAST, SLOT, START, Buffers, FeatureRing, rows_key
from .fused import lm_logits
from .graphs import Graphs
from .kv import FrozenTargetKV, Rows, RowsAttention, StaticKV, StaticStore


@triton.jit
def _window_kernel(meta, drafts, ids, positions, stride_meta, K, W, LAST_ROW: tl.constexpr,
                   START_ROW: tl.constexpr, BLOCK: tl.constexpr):
    """Row n's verify window: ids [last token, drafts], positions start .. start + W - 1."""
    n = tl.program_id(0)
    t = tl.arange(0, BLOCK)
    last = tl.load(meta + LAST_ROW * stride_meta + n)
    start = tl.load(meta + START_ROW * stride_meta + n)
    draft = tl.load(drafts + n * K + t - 1, mask=(t > 0) & (t < W), other=0)
    tl.store(ids + n * W + t, tl.where(t == 0, last, draft), mask=t < W)
    tl.store(positions + n * W + t, start + t, mask=t < W)


@dataclass(frozen=True)
class Ahead:
    """A round in flight: the rows it was launched for and where its results land."""

    key: tuple  # (((rid, length), ...), bucket, width)
    logits: Tensor  # [bucket, W, V] graph output
    features: Tensor | None
    host: Tensor  # [bucket, 2 + W] pinned: finite, accepted, tokens
    copied: torch.cuda.Event | None  # set once host holds them (None: the copy was synchronous)


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
            self.ring = FeatureRing(capacity.max_batch, width + 1, taps, dtype, device)
        self.graphs = Graphs(enabled=device.type == "cuda" and capacity.graphs)
        self.buckets = buckets_for(capacity.max_batch)
        self._decided: tuple[tuple, Tensor] | None = None  # the round verify() already decided
        self._ahead: Ahead | None = None  # the next round, launched before this one was booked
        self._host_copy: dict[torch.Size, Tensor] = {}  # pinned landing buffers for its verdict
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
                         features=None if self.ring is None else self.ring.read(slots, start - 1))

    @torch.inference_mode()
    def draft(self, reqs: list[Request]) -> Proposal:
        if self.drafter is None:
            return self.skip_draft(reqs)
        n, bucket = len(reqs), self.bucket(len(reqs))
        if self._ahead is not None and self._ahead.key == (rows_key(reqs), bucket, self.width):
            return Proposal(tokens=self.bufs.drafts[:n])  # the round in flight drafted these rows
        self._ahead = None
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
        kernel, finiteness): the host then copies one small tensor back and accept() is free."""
        n, bucket, width = len(reqs), self.bucket(len(reqs)), proposal.tokens.shape[1] + 1
        decide = proposal.probs is None and not _filtered(reqs)
        ahead, self._ahead = self._ahead, None
        if decide and ahead is not None and ahead.key == (rows_key(reqs), bucket, width) and \
                (width == 1 or proposal.tokens.data_ptr() == self.bufs.drafts.data_ptr()):
            if ahead.copied is not None:
                ahead.copied.synchronize()
            self.rounds_ahead += 1
            return self._verdict(reqs, ahead.host[:n].clone(), ahead.logits, ahead.features)  # host is reused
        self.bufs.load(reqs, bucket)
        if width > 1 and proposal.tokens.data_ptr() != self.bufs.drafts.data_ptr():
            self.bufs.drafts[:n, : width - 1].copy_(proposal.tokens)
        logits, features, packed = self.graphs.run(("verify", width, bucket, decide),
                                                   lambda: self._verify_step(bucket, width, decide))
        if packed is None:
            return Verification(logits=logits[:n], features=None if features is None else features[:n])
        return self._verdict(reqs, packed[:n].cpu(), logits, features)  # the round's one copy back

    def _verdict(self, reqs: list[Request], host: Tensor, logits: Tensor, features: Tensor | None) -> Verification:
        """host [n, 2 + W] from a deciding verify graph: finite, accepted, tokens."""
        n = len(reqs)
        self._decided = (rows_key(reqs), host[:, 1:])
        return Verification(logits=logits[:n], features=None if features is None else features[:n],
                            finite=host[:, 0].bool())

    def _verify_step(self, bucket: int, width: int, decide: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
        b = self.bufs
        ids = torch.empty(bucket, width, dtype=torch.int64, device=self.device)  # [bucket, W]
        positions = torch.empty_like(ids)  # [bucket, W]
        _window_kernel[(bucket,)](b.meta, b.drafts, ids, positions, b.meta.stride(0), b.drafts.shape[1], width,
                                  LAST_ROW=LAST, START_ROW=START, BLOCK=triton.next_power_of_2(width))
        attn = RowsAttention(self.cache, Rows(b.row(SLOT, bucket), b.row(START, bucket)), causal=True)
        hidden, features = self.target(ids, positions, attn, self.plan.target_layer_ids)  # fused: attn.decoder_stack
        if self.drafter is not None and self.drafter.graph_safe and features is not None:
            self.drafter.extend_rows(self._rows(bucket), features, ids)  # reads the ring before it moves on
        if self.ring is not None:
            self.ring.write(b.row(SLOT, bucket), b.row(START, bucket), features)
        logits = lm_logits(self.target.lm_head, hidden)  # [bucket, W, V] float32, as target.logits
        if not decide:
            return logits, features, None
        batch = b.sampling(bucket)
        num, tokens = kernels.accept_matching(logits, b.drafts[:bucket, : width - 1], batch.seed,
                                              b.row(START, bucket) + 1, inv_temp=_inverse(batch.temperature))
        finite = torch.isfinite(logits).flatten(1).all(dim=1)
        return logits, features, torch.cat([finite[:, None].long(), num[:, None], tokens], dim=1)

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
        elif used:
            self._run_ahead(reqs, out, proposal.tokens.shape[1] + 1)
        return Verdict(num_accepted=out[:, 0], tokens=out[:, 1:])

    def _run_ahead(self, reqs: list[Request], out: Tensor, width: int) -> None:
        """Launch the next round for the same rows before the host books this one, so the
        GPU does not idle through the engine's bookkeeping. Its inputs are known now: each
        row's last emitted token and new length. It is used only if the next round asks for
        exactly these rows at these lengths and this width; otherwise its results are
        ignored (what it wrote to the caches lies past each row's length, or in slots that
        later work overwrites in stream order). Rows that this round finishes stop it."""
        last, lens = [], []
        for req, row in zip(reqs, out.tolist()):
            emitted = row[1 : row[0] + 2]
            if req.cancelled or req.finishes_with(emitted):
                return
            last.append(emitted[-1])
            lens.append(req.seq_len + len(emitted))
        bucket = self.bucket(len(reqs))
        self.bufs.load(reqs, bucket, (last, lens))
        if width > 1:
            self.graphs.run(("draft", bucket), lambda: self._draft_step(bucket))
        logits, features, packed = self.graphs.run(("verify", width, bucket, True),
                                                   lambda: self._verify_step(bucket, width, True))
        copied, pinned = None, self.device.type == "cuda"
        host = self._host_copy.get(packed.shape)
        if host is None:
            host = self._host_copy[packed.shape] = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=pinned)
        host.copy_(packed, non_blocking=pinned)
        if pinned:
            copied = torch.cuda.Event()
            copied.record()
        self._ahead = Ahead((rows_key(reqs, lens), bucket, width), logits, features, host, copied)

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
    return logits, _inverse(batch.temperature)


def _inverse(temperature: Tensor) -> Tensor:
    return torch.where(temperature > 0, 1.0 / temperature.clamp(min=1e-6), torch.zeros_like(temperature))
