"""The cuda backend: static KV, persistent buffers, graph-captured rounds.

``launch`` enqueues one round for a bucket of rows and returns at once: copy the rows' slots
and sampling parameters in (only when they changed), replay the round's graph (gather each
row's last token and start from its slot's state, draft, target forward over [last token,
drafts] with the drafter's context update beside it, the acceptance, and each live row's new
state), then one small asynchronous copy back. ``collect`` waits for that copy. Since a round
starts from the device's state, the machine may launch the next rounds before it has read
this one. Prefill (prefill.py) batches the admitted prompts and chunks into few forwards (a
graph for short ones) and lands its first tokens as a round does, so rounds may follow it
before the host reads them.
Every graph the spec can use is captured by ``prepare`` at start-up, over padding rows only.
A round with rows that filter (top-k / top-p), adjust logits (penalties, logit_bias,
min_new_tokens: penalties.py) or report logprobs (logprobs.py) replays the graph that leaves
the verify logits, and accepts eagerly over them; other rounds never take that path. A round
under a grammar's masks runs its draft step, verify forward and masked decision as graphs apart,
the first two ahead of the host (constrained.py).
Without a GPU the same code runs eagerly through the Triton interpreter (TRITON_INTERPRET=1),
which is how CI holds it to the reference backend.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import structlog
import torch
import triton
import triton.language as tl
from torch import Tensor

from draftline.core.contract import Capacity, DraftOverride, DraftRows, RoundResult, narrowing_widths
from draftline.core.machine import Plan
from draftline.core.methods.base import Drafter, Method
from draftline.core.models.config import ConfigError
from draftline.core.models.ops import Forward
from draftline.core.models.target import TargetModel
from draftline.core.request import Request, SpecStats
from draftline.core.walk import candidates, chosen, masked
from draftline.core.sampling import Filters, SamplingParams, probs_from_logits

from . import events
from .constrained import ConstrainedRounds
from . import logprobs as target_logprobs
from . import overlap
from . import sampling as kernels
from .attention import INVARIANT_QUERY_ROWS
from .beside import PrefillStream, beside_wanted
from .buffers import DRAFT_SLOT, INV_TEMP, LAST, SEED, SLOT, START, Buffers, FeatureRing
from .head import head_draw, lm_logits
from .linear import fuse
from .graphs import Graphs
from .landing import Landing, Launch
from .kv import FrozenTargetKV, Rows, StaticKV, StaticStore, cache_splits
from .matvec import MAX_ROWS, ArgmaxScratch, Draw, take_draws
from .ops import CudaOps
from .memory import GIB, KVBudget, size_pool
from .penalties import SlotPenalties
from .prefill import PREFILL_WIDTHS, Prefiller, draw_scores
from .staging import Staging
from .views import CAUSAL, LONG_WINDOW, KVView
from .windows import verify_window

log = structlog.get_logger("draftline.cuda")

MAX_DEPTH = 2  # rounds the machine may launch for a row beyond the one it collects next
# a drafting round's verify tokens (rows x (K + 1)) from which narrower verify widths are captured
# too: below it the verify is bound by reading the weights, and the full width costs the same
NARROW_TOKENS = 64
# the sampling passes of a graph's rows that draw from q: temperature alone (rows with top-k or
# top-p read their logits on the host, drafted and accepted eagerly)
SAMPLED = Filters(greedy=False, top_k=False, top_p=False)


@triton.jit
def _settle_kernel(meta, drafts, num, tokens, bad, packed, state, stride_meta, stride_state, K, W, scratch,
                   LAST_ROW: tl.constexpr, START_ROW: tl.constexpr, SLOT_ROW: tl.constexpr, REAL: tl.constexpr,
                   CHUNKS: tl.constexpr, BLOCK: tl.constexpr, DRAWN: tl.constexpr):
    """Row n of a decided round: packed [finite, accepted, tokens (W), drafts (W - 1)] for the
    host (finite: none of its W draws counted a non-finite logit), and a live row's new state
    (its last token and start after the round) at its slot, where the next round starts from.
    ``num``, ``tokens`` and ``bad`` [rows, CHUNKS] are accept_matching's (or the eager path's,
    CHUNKS 1); with DRAWN, ``tokens`` and ``bad`` are the scratch the head's matvec_draw left
    its draws in (taken here), and the acceptance is made here: drafts are accepted while they
    match the draws."""
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
    slot = tl.load(meta + SLOT_ROW * stride_meta + n)
    live = slot != scratch  # padding rows never move: the scratch slot stays at position 0
    start = tl.load(meta + START_ROW * stride_meta + n)
    tl.store(state + slot, last, mask=live)
    tl.store(state + stride_state + slot, start + accepted + 1, mask=live)


def buckets_for(max_batch: int) -> list[int]:
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class CudaBackend:
    name = "cuda"
    default_depth = 2
    max_depth = MAX_DEPTH
    # everything SamplingParams asks; rounds whose rows use none keep the graph-decided path
    features = frozenset({"penalties", "logprobs", "prompt_logprobs", "structured"})

    def __init__(self, target: TargetModel, method: Method, plan: Plan, device: torch.device, dtype: torch.dtype,
                 capacity: Capacity):
        if getattr(target, "shard", None) is not None:
            raise ConfigError("model.tensor_parallel_size > 1 runs on the reference backend for now (gloo); set "
                              "backend: reference, or tensor_parallel_size: 1 on the cuda backend")
        cfg, width = target.config, plan.num_speculative_tokens + 1
        self.target, self.plan, self.device, self.width = target, plan, device, width
        self.capacity = capacity
        self.staging = Staging(device)  # host values onto the device (_put), before anything that puts
        # rounds in flight past a row's stop write up to MAX_DEPTH + 1 windows beyond its length
        margin = (MAX_DEPTH + 1) * max(width, plan.block_size or 0)
        self.buckets = buckets_for(capacity.max_batch)
        # the operations every forward runs with, the drafter's too (its greedy readouts' scratch: Buffers.argmax)
        self.ops = CudaOps(ArgmaxScratch(device, max(MAX_ROWS, capacity.max_batch * width)))
        self.kv = StaticStore(capacity.max_batch, capacity.max_model_len + margin, device, self.ops)
        self.drafter: Drafter | None = method.build_drafter(plan, target, self.kv, device, dtype)
        self.narrow = {b: self._narrower(b) for b in self.buckets}  # bucket -> its narrower verify widths
        invariant = _invariant(capacity, cfg, width)
        taps = len(plan.target_layer_ids) * cfg.hidden_size  # target features a token the drafter reads
        self.kv_budget = self._kv_budget(capacity, width, dtype, capacity.max_model_len + margin, invariant,
                                         taps if self.drafter is not None else 0)
        self.kv_pages = capacity.kv_pages or (self.kv_budget.pages if self.kv_budget else 0)  # 0: static slots
        if not self.kv_pages and capacity.prefix_block and invariant:  # cached prefixes are shared pages: a
            self.kv_pages = capacity.max_batch * -(-(capacity.max_model_len + margin) // capacity.kv_page)  # static slot's memory
        paged = (self.kv_pages, capacity.kv_page) if self.kv_pages else None
        self.cache = StaticKV(cfg.num_layers, capacity.max_batch, cfg.num_kv_heads, capacity.max_model_len + margin,
                              cfg.head_dim, dtype, device, invariant=invariant, paged=paged,
                              put=self._put)
        self.kv.share(self.cache.pager)  # the drafter's caches page with the target's table
        drafter_model = getattr(self.drafter, "model", None)
        for model in (target, drafter_model):  # before any capture: fusing frees the old weights a graph would
            if model is not None:  # have baked in
                fuse(model)
        if drafter_model is not None:
            self.kv.allocate(drafter_model)
        if self.drafter is not None and not self.drafter.graph_safe:
            raise ConfigError(f"method {plan.method}: its drafter is not graph-safe (it reads the host's requests, "
                              "not the device's rows), and the cuda backend runs rounds ahead of the host; "
                              "use backend: reference for this method")
        self.bufs = Buffers(capacity.max_batch, plan.num_speculative_tokens, self.cache.scratch, device, self.ops.scratch)
        self.ring: FeatureRing | None = None  # the last verified features, for drafters that read them
        if self.drafter is not None and self.drafter.reads_last_features:
            self.ring = FeatureRing(capacity.max_batch, 2 * width + 1, taps, dtype, device)
        self.graphs = Graphs(enabled=device.type == "cuda" and capacity.graphs)
        # prefills on a stream of their own, beside the rounds, where asked for (beside.py)
        self.beside = PrefillStream(device, beside_wanted(device, self.graphs.enabled))
        self.prefill_beside = self.beside.stream is not None  # the machine's rows join the step after their prefill
        self.branch = overlap.Branch(device)  # the drafter's context update, beside the verify step's LM head
        self.landing = Landing(device, capacity.max_batch)  # where rounds' results come back to the host
        self.draft_override: DraftOverride | None = None  # bench --acceptance (set_draft_override)
        self.constrained = ConstrainedRounds(self)  # rounds under a grammar's masks
        self.penalties = SlotPenalties(self.cache.scratch, cfg.vocab_size, device, self._put)
        # short prefills' graphs (DRAFTLINE_PREFILL_GRAPHS=0 prefills eagerly, for comparison)
        self.prefiller = Prefiller(target, plan, capacity, self.cache, self.kv, self.drafter, self.ring, self.ops,
                                   self.bufs, self.penalties, self.landing, self.beside, self.staging,
                                   tuple(self.buckets), self._prefill_graphs())
        store = self.prefiller.prefix_store
        self.prefix = None if store is None else store.index  # the engine's view of what is cached

    def _kv_budget(self, capacity: Capacity, width: int, dtype: torch.dtype, max_len: int, invariant: bool,
                   taps: int) -> KVBudget | None:
        """The paged pool server.gpu_memory_utilization fits (memory.py), when the spec sets it
        and not server.num_kv_blocks; once the weights are on the device. ``max_len`` and
        ``invariant``: the cache's, for its attention plan's scratch; ``taps``: the features a
        token the drafter reads, which the prefill graphs keep."""
        if not capacity.kv_memory or capacity.kv_pages:
            return None
        if self.device.type != "cuda":
            log.info("kv.pool", detail="server.gpu_memory_utilization ignored: no GPU (static slots)")
            return None
        torch.cuda.empty_cache()  # what the allocator caches (the weights' random init, an engine before) is free
        free, total = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        budget = size_pool(capacity, self.target.config, getattr(self.drafter, "model", None), width, self.buckets,
                           dtype, (free + cached, total), functools.partial(cache_splits, max_len, invariant,
                                                                             self.target.config.num_kv_heads), taps,
                           self.narrow.__getitem__)
        log.info("kv.pool", gpu_memory_utilization=capacity.kv_memory, **budget.summary())
        return budget

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    @property
    def chunked_prefill(self) -> bool:
        return self.prefiller.chunked

    def _prefill_graphs(self) -> Graphs:
        """Short prefills' graphs, in the rounds' memory pool where they run in one stream (a
        prefill's temporaries are a round's), their own beside them."""
        return Graphs(enabled=self.graphs.enabled and os.environ.get("DRAFTLINE_PREFILL_GRAPHS") != "0",
                      pool=None if self.prefill_beside else self.graphs)

    def prefill(self, reqs: list[Request], ends: list[int] | None = None) -> Launch:
        return self.prefiller.prefill(reqs, ends)

    def set_draft_override(self, override: "DraftOverride | None") -> dict:
        """Rewrite every greedy draft step's drafts (draftline.core.simulated, for bench --acceptance);
        the graphs are captured again with it inside."""
        self.draft_override = self.prefiller.draft_override = override
        self.constrained.drop()  # its forward ran in the graphs replaced here
        self.graphs = Graphs(enabled=self.graphs.enabled)
        self.prefiller.graphs = self._prefill_graphs()
        if self.graphs.enabled:  # the old graphs' pool back to the device before the new ones' captures
            torch.cuda.empty_cache()
        return self.prepare()

    # ------------------------------------------------------------------ start-up

    @torch.inference_mode()
    def prepare(self) -> dict:
        """Capture every graph the spec can replay, for every bucket, before any request: warm-up
        prefills make the drafter's caches and compile the eager kernels at every specialization
        a prompt can hit, then each round graph is captured over padding rows (scratch slot,
        position 0), whose state no round moves, so capture changes nothing a request reads;
        then the short prefills' graphs, over the scratch slot."""
        if not self.graphs.enabled:
            return {"graphs": 0, "seconds": 0.0}
        begin, reserved = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        prefills = self.prefiller.graphs
        graphed, prefills.enabled = prefills.enabled, False
        self._warm_prefill(2)  # eager: the drafter's caches are made outside any capture
        prefills.enabled = graphed
        for length in range(2, LONG_WINDOW + 2):  # every kernel specialization an eager prefill can hit
            self._warm_prefill(length)
        for bucket in self.buckets[1:]:  # and every batch size's (the eager tail's shapes follow the rows)
            self._warm_prefill(2, bucket)
        for width in PREFILL_WIDTHS if self.chunked_prefill else ():  # a later chunk's eager path, drafter's too
            self._warm_prefill(2 * width, chunk=width)
        for bucket in self.buckets[1:] if self.chunked_prefill else ():  # and at every batch size
            self._warm_prefill(2 * PREFILL_WIDTHS[0], bucket, chunk=PREFILL_WIDTHS[0])
        self.bufs.load([], self.capacity.max_batch)
        warmed = torch.cuda.memory_reserved(self.device) - reserved  # the prefix store, and eager temporaries kept cached
        for bucket in self.buckets:
            for key in self._graph_keys(bucket):
                self._replay(*key)
            self.constrained.capture(bucket)  # a grammar's rounds: draft, forward, masked decision apart
        sampled = self.drafter is not None and self.width > 1 and self.plan.draft_sample_method != "greedy"
        for bucket in self.buckets if sampled else ():
            self._warm_sampled(min(bucket, self.capacity.max_batch))
        self.prefiller.capture()
        self.graphs.seal()
        prefills.seal()
        self.beside.active = self.prefill_beside  # requests' prefills from now on
        self.landing.mark_origin()
        torch.cuda.synchronize()
        # what start-up reserved, beside what the pool's sizing set aside (kv_budget.workspace)
        memory = {"warm_up_gib": round(warmed / GIB, 2), "round_graphs_gib": round(self.graphs.grown / GIB, 2),
                  "prefill_graphs_gib": round(prefills.grown / GIB, 2),
                  "peak_reserved_gib": round(torch.cuda.max_memory_reserved(self.device) / GIB, 2)}
        return {"graphs": len(self.graphs) + len(prefills), "seconds": round(time.perf_counter() - begin, 3),
                "memory": memory}

    def _warm_prefill(self, length: int, n: int = 1, chunk: int | None = None) -> None:
        """n prompts of ``length`` tokens prefilled (with ``chunk``: that many first, then the rest)."""
        if length < self.capacity.max_model_len:
            warm = self._warm_requests(length, n, SamplingParams(max_new_tokens=1))
            if chunk is not None:
                self.collect(self.prefill(warm, [chunk] * n))
            self.collect(self.prefill(warm))
            for req in warm:
                self.free(req)

    def _warm_sampled(self, n: int) -> None:
        """A drafting round of n rows that sample through top-p, drafts drawn from q: the eager
        path such rows take (the drafter's draws, the rejection kernel) compiled now, not in a
        request's first such round."""
        params = SamplingParams(max_new_tokens=self.width + 1, temperature=1.0, top_p=0.9, seed=0)
        warm = self._warm_requests(2, n, params)
        self.collect(self.prefill(warm))
        self.collect(self.launch(warm, self.width))
        for req in warm:
            self.free(req)

    def _warm_requests(self, length: int, n: int, params: SamplingParams) -> list[Request]:
        return [Request(rid=-1, prompt_ids=[0] * length, params=params, stop_ids=frozenset(),
                        max_model_len=self.capacity.max_model_len, stats=SpecStats(self.plan.num_speculative_tokens))
                for _ in range(n)]

    def _graph_keys(self, bucket: int) -> list[tuple]:
        """(bucket, width, decide, drafts inside, drafts sampled): plain rounds, and drafting
        rounds (their draft step inside the graph: the drafter's argmax, or, where the spec
        drafts probabilistically, draws from its q that the graph's rejection step accepts);
        deciding on the device, or leaving logits for eager acceptance (top-k / top-p), which
        takes the full width; a window drafted apart (such rows' sampled drafts, a grammar's
        rounds) leaves its logits too. Narrower widths decide on the device."""
        keys = [(bucket, 1, True, False), (bucket, 1, False, False)]
        if self.width > 1:
            keys += [(bucket, self.width, False, True), (bucket, self.width, True, True)]
            keys += [(bucket, self.width, False, False)]
            keys += [(bucket, w, True, True) for w in self.narrow[bucket]]
            if self.plan.draft_sample_method != "greedy":
                keys += [(bucket, w, True, True, True) for w in (self.width, *self.narrow[bucket])]
        return keys

    def _narrower(self, bucket: int) -> tuple[int, ...]:
        """The narrower verify widths a drafting round of ``bucket`` rows may take (captured:
        the greedy drafts' graphs decide on the device), where its full verify may be compute-bound."""
        if self.drafter is None or bucket * self.width < NARROW_TOKENS:
            return ()
        return narrowing_widths(self.width - 1)[1:]

    def verify_widths(self, rows: int) -> tuple[int, ...]:
        return () if self.drafter is None else (self.width, *self.narrow[self.bucket(rows)])

    # ------------------------------------------------------------------ host values and logprobs

    def _put(self, host: Tensor) -> Tensor:
        """Host values onto the device without waiting: a pinned, asynchronous copy (a plain
        one waits for every round in flight, which would drain the pipeline at each prefill)."""
        return self.staging.put(host)

    # ------------------------------------------------------------------ rounds

    @torch.inference_mode()
    def launch(self, reqs: list[Request], width: int, then: int | None = None) -> Launch:
        n, bucket = len(reqs), self.bucket(len(reqs))
        width = min(width, self.width) if self.drafter is not None else 1
        self.beside.join(reqs)  # rows whose prefill runs beside: their first round waits for it
        if self.cache.pager is not None:  # paged KV: pages for the positions this round and those in flight write
            for r in reqs:
                self.cache.reserve(r.kv, r.seq_len + self.capacity.kv_lookahead)
            self.cache.flush()
        # drafts drawn from the drafter's q (rows that sample, where the spec drafts so): drawn and
        # accepted inside the round's graph, q and all; greedy rows' drafts are its argmax
        sampled = width > 1 and self.plan.draft_sample_method != "greedy" and any(r.params.temperature > 0 for r in reqs)
        constrained = any(r.grammar is not None for r in reqs)  # its masks read the drafts before the verify
        # rows that filter, adjust or report logits take the eager acceptance over the graph's logits,
        # as do sampled drafts under a grammar (drawn from q under its masks: core.walk.chosen)
        beyond = any(r.params.reads_logits_beyond_masks for r in reqs)
        decide = not beyond and not (sampled and constrained)
        if width > 1 and (not decide or constrained or width not in self.verify_widths(n)):
            width = self.width  # logits read on the host, or masked: the full window's graph
        if constrained and decide:  # the graphs mask the verify's logits, then decide (constrained.py)
            then = width if then is None else (1 if then == 1 else self.width)  # drafting: the full window again
            return self.constrained.launch(reqs, bucket, width, then)
        self.constrained.drop()
        started = self.landing.started()
        self.bufs.load(reqs, bucket)
        eager = width > 1 and ((sampled and not decide) or constrained)
        probs = self._eager_drafts(reqs, bucket, width, sampled) if eager else None
        logits, packed = self._replay(bucket, width, decide, width > 1 and not eager, sampled and decide)
        reported = []
        if packed is None:
            packed = self._accept(reqs, width, logits[:n], probs)
            first = self.bufs.row(START, n) + 1  # this round's (the next launch gathers anew)
            reported = target_logprobs.pending(reqs, logits[:n], packed[:, 2 : 2 + width], first)
        return self.landing.land(packed[:n], width, reported, started)

    def _eager_drafts(self, reqs: list[Request], bucket: int, width: int, sampled: bool) -> Tensor | None:
        """A round's drafts proposed outside its graph: drawn from q (``sampled``: q goes to the
        acceptance), or for rows that read their logits beside a grammar, which chooses them
        again under its masks (core.walk.chosen) -> q [n, W - 1, V], or None."""
        n = len(reqs)
        self.bufs.gather(bucket)
        rows = self._rows(bucket, width - 1, greedy=not sampled, scores=any(r.grammar is not None for r in reqs),
                          filters=Filters.of([r.params for r in reqs]))
        proposal = chosen(reqs, self.drafter.propose(reqs, rows).first(width - 1).rows(list(range(n))))
        self.bufs.drafts[:n, : width - 1].copy_(proposal.tokens)
        return proposal.probs

    def attention_bandwidth(self, contexts: list[int], batch: int, width: int) -> list[tuple[int, float, float, float]]:
        """The verify attention kernel alone over the target's KV geometry (attention.attention_bandwidth)."""
        from .attention import attention_bandwidth

        return attention_bandwidth(self.target.config, self.cache.data.dtype, self.device, contexts, batch, width)

    @property
    def timeline(self) -> list | None:
        """The launches' device spans, kept while set to a list (draftline bench)."""
        return self.landing.timeline

    @timeline.setter
    def timeline(self, spans: list | None) -> None:
        self.landing.timeline = spans

    def _replay(self, bucket: int, width: int, decide: bool, inside: bool, sampled: bool = False
                ) -> tuple[Tensor | None, Tensor | None]:
        return self.graphs.run(("round", bucket, width, decide, inside, sampled),
                               lambda: self._round_step(bucket, width, decide, inside, sampled))

    def _round_step(self, bucket: int, width: int, decide: bool, inside: bool, sampled: bool = False
                    ) -> tuple[Tensor | None, Tensor | None]:
        """One round's device work from the rows' slot state; idempotent (capture runs it for
        real): it reads ``state`` and writes it only at the end, and only for live rows.
        ``sampled``: the drafts are draws from the drafter's q, which the decision reads."""
        self.bufs.gather(bucket)
        q = self._draft_step(bucket, width, sampled=sampled) if inside else None
        return self._verify_step(bucket, width, decide, q)

    def _draft_round(self, bucket: int, width: int, ranked: Tensor | None = None) -> None:
        """A round's draft step alone, from the rows' slot state (a constrained round's, whose
        host reads the drafts before it masks the verify: constrained.py), each slot's best
        tokens by the drafter into ``ranked`` [bucket, K, M] where given."""
        self.bufs.gather(bucket)
        self._draft_step(bucket, width, ranked)

    def collect(self, handle: Launch) -> RoundResult:
        return self.landing.collect(handle)

    # ------------------------------------------------------------------ draft

    def _rows(self, bucket: int, drafts: int = 0, positions: Tensor | None = None, end: Tensor | None = None,
              greedy: bool = False, scores: bool = False, filters: Filters | None = None) -> DraftRows:
        """The rows as a drafter sees them; ``end`` [bucket]: start + the width of the forward
        their caches serve (the verify's, for its context update), where it is on the device;
        ``greedy``: every row is (its drafts the drafter's argmax); ``scores``: keep the drafter's
        logits; ``filters``: the rows' sampling passes (DraftRows.filters)."""
        b = self.bufs
        slots, start = b.row(SLOT, bucket), b.row(START, bucket)
        return DraftRows(last_token=b.row(LAST, bucket), start=start, batch=b.sampling(bucket),
                         caches=Rows(b.row(DRAFT_SLOT, bucket)), target_kv=FrozenTargetKV(self.cache, slots, start),
                         features=None if self.ring is None else self.ring.read(slots, start, shift=-1),
                         drafts=drafts, positions=positions, end=end, greedy=greedy, scores=scores,
                         filters=filters)

    def _draft_step(self, bucket: int, width: int, ranked: Tensor | None = None, sampled: bool = False
                    ) -> Tensor | None:
        """The drafts of a round verifying ``width`` tokens (a chain stops after width - 1 steps):
        the drafter's argmax, or with ``sampled`` draws from its q -> q [bucket, W - 1, V], else None."""
        # a graph's rows take temperature alone (rows with top-k / top-p are drafted eagerly)
        rows = self._rows(bucket, width - 1, greedy=not sampled, scores=ranked is not None,
                          filters=SAMPLED if sampled else None)
        proposal = self.drafter.propose([], rows)
        tokens = proposal.tokens  # [bucket, K], or its first width - 1 columns
        self.bufs.drafts[:bucket, : tokens.shape[1]].copy_(tokens)
        if ranked is not None:
            ranked[:, : tokens.shape[1]].copy_(candidates(proposal.scores))
        if self.draft_override is not None:
            self.draft_override(self.bufs.row(SLOT, bucket), rows.start, self.bufs.drafts[:bucket])
        return proposal.probs if sampled else None

    # ------------------------------------------------------------------ verify

    def _verify_step(self, bucket: int, width: int, decide: bool, q: Tensor | None = None
                     ) -> tuple[Tensor | None, Tensor | None]:
        """Target forward over each row's [last token, drafts]; with ``decide`` the round's
        acceptance too (packed, and the rows' new state), else only the logits; ``q``
        [bucket, W - 1, V]: the drafter's distributions the drafts were drawn from."""
        b = self.bufs
        ids, positions, ends = verify_window(b.meta, b.drafts, bucket, width, LAST, START)  # [bucket, W] each, [bucket]
        started = False

        def extend(features: Tensor) -> None:  # [bucket, W, taps*H], once the last tapped layer is done
            nonlocal started
            if self.drafter is not None and self.drafter.graph_safe and not started:
                started = True  # beside the layers after the last tap and the LM head: only the next round
                with self.branch.fork():  # reads the drafter's cache; ring row start - 1 is not written below
                    self.drafter.extend_rows(self._rows(bucket, positions=positions, end=ends), features, ids)

        fwd = Forward(positions, KVView(self.cache, b.row(SLOT, bucket), ends, CAUSAL), self.plan.target_layer_ids,
                      on_tapped=extend, invariant=self.cache.invariant)
        hidden, features = self.target.run(self.ops, fwd, ids)
        if self.ring is not None:
            self.ring.write(b.row(SLOT, bucket), b.row(START, bucket), features)
        logits = None
        if decide and q is None:  # the head folds the round's draws where it can (into b.argmax; the settle takes them)
            draw = Draw(b.row(SEED, bucket), b.row(START, bucket), b.fmeta[INV_TEMP, :bucket], width, shift=1)
            logits = head_draw(self.target.lm_head, hidden, b.argmax, draw, self.cache.invariant)
        drawn = logits is not None
        if not drawn:  # [bucket, W, V] float32, as target.logits
            logits = lm_logits(self.target.lm_head, hidden, self.cache.invariant)
        if decide and q is not None:  # the rejection rule decides; the logits stay inside (no output kept)
            p = probs_from_logits(logits, b.sampling(bucket), SAMPLED)  # temperature alone, as the graph's rows take
            packed, logits = self._reject(bucket, width, p, q, logits), None
        else:
            packed = self._decide(bucket, width, logits, drawn) if decide else None
        self.branch.join()
        return logits, packed

    def _decide(self, bucket: int, width: int, logits: Tensor, drawn: bool) -> Tensor:
        """Decide the round on the device -> packed [bucket, 2W + 1] for the one copy back; each
        live row's last token and start after it go to its slot's state. With ``drawn`` the
        head folded the draws into ``bufs.argmax`` (head_draw); otherwise they are made here."""
        b = self.bufs
        if drawn:
            return self._settle(bucket, width, b.argmax.best, b.argmax.best, b.argmax.bad, 1, 1, True)
        _, real, chunks = kernels.chunking(logits.shape[-1])
        bad = torch.empty(bucket * width, chunks, dtype=torch.int32, device=self.device)  # [bucket * W, chunks]
        num, tokens = kernels.accept_matching(logits, b.drafts[:bucket, : width - 1], b.row(SEED, bucket),
                                              b.row(START, bucket), inv_temp=b.fmeta[INV_TEMP, :bucket],
                                              bad=bad, shift=1)
        return self._settle(bucket, width, num, tokens, bad, real, chunks, False)

    def _reject(self, rows: int, width: int, p: Tensor, q: Tensor, logits: Tensor) -> Tensor:
        """Decide a round whose drafts were drawn from q [rows, W - 1, V]: the rejection rule over
        the target's p [rows, W, V], then the settle (non-finite counts of the raw ``logits``)."""
        b = self.bufs
        num, tokens = kernels.accept_rejection(p, q, b.drafts[:rows, : width - 1], b.row(SEED, rows),
                                               b.row(START, rows) + 1)  # the first draft's position
        return self._settle(rows, width, num, tokens, kernels.nonfinite(logits), 1, 1, False)

    def _settle(self, rows: int, width: int, num: Tensor, tokens: Tensor, bad: Tensor, real: int, chunks: int,
                drawn: bool) -> Tensor:
        b = self.bufs
        packed = torch.empty(rows, 2 * width + 1, dtype=torch.int64, device=self.device)
        _settle_kernel[(rows,)](b.meta, b.drafts, num, tokens, bad, packed, b.state, b.meta.stride(0),
                                b.state.stride(0), b.drafts.shape[1], width, self.cache.scratch, LAST_ROW=LAST,
                                START_ROW=START, SLOT_ROW=SLOT, REAL=real, CHUNKS=chunks,
                                BLOCK=triton.next_power_of_2(width), DRAWN=drawn)
        return packed

    # ------------------------------------------------------------------ eager acceptance

    def _accept(self, reqs: list[Request], width: int, logits: Tensor, probs: Tensor | None) -> Tensor:
        """Acceptance outside the graph (drafts from q, or rows with top-k / top-p, penalties
        or logprobs), then the same settle: packed [n, 2W + 1] and the rows' new state; the
        adjusting rows' emitted tokens are counted for the rounds after it."""
        n, b = len(reqs), self.bufs
        batch = b.sampling(n)
        start = b.row(START, n)
        drafts = b.drafts[:n, : width - 1]
        adjusted = self.penalties.adjust(logits, reqs, start, drafts)  # each slot as plain decoding there
        adjusted = masked(adjusted, reqs, drafts)  # and each constrained row's grammar after the drafts before
        if probs is not None:
            p = probs_from_logits(adjusted, batch, Filters.of([r.params for r in reqs]))  # no wait on the device
            packed = self._reject(n, width, p, probs, logits)
        else:
            scores, inv_temp = draw_scores(adjusted, reqs, batch)
            num, tokens = kernels.accept_matching(scores, drafts, batch.seed, start + 1, inv_temp=inv_temp)
            packed = self._settle(n, width, num, tokens, kernels.nonfinite(logits), 1, 1, False)  # of the raw logits
        self.penalties.count(reqs, packed[:, 2 : 2 + width], packed[:, 1])
        return packed

    def free(self, req: Request) -> None:
        self.constrained.release(req)  # its row of the round run ahead is padding from now on
        self.bufs.forget()  # a preempted request comes back under its id in other slots
        self.beside.forget(req.kv)
        self.prefiller.release(req)
        if req.kv is not None:
            self.penalties.rows.pop(req.kv, None)
            self.cache.release(req.kv)
            req.kv = None
        if self.drafter is not None:
            if req.draft_state is not None and hasattr(req.draft_state, "index"):
                self.kv.release(req.draft_state)
            self.drafter.release(req)


def _invariant(capacity: Capacity, cfg, width: int) -> bool:
    """Whether the target's rows take the batch-invariant kernels: as the spec asks, where the
    verify window's query rows per kv head fit the invariant attention tile. Unset in the spec,
    a window that does not fit runs without the guarantee, with a warning; set, it is refused."""
    rows = cfg.num_heads // cfg.num_kv_heads * width
    if not capacity.invariant or rows <= INVARIANT_QUERY_ROWS:
        return capacity.invariant
    why = (f"model.batch_invariant: a verify window of {width} tokens x {rows // width} query heads per kv head "
           f"exceeds the invariant attention tile ({INVARIANT_QUERY_ROWS} rows)")
    if capacity.invariant_required:
        raise ConfigError(f"{why}; draft fewer tokens or set model.batch_invariant: false")
    log.warning("batch_invariant_off", reason=why, effect="drafting may change a bf16 token on the GPU")
    return False
