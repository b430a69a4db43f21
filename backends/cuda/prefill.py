"""The cuda backend's prefill: admitted prompts, and chunks of longer ones, through the target
in few batched forwards, their first tokens drawn and landed as a round's are.

A step's prompts are grouped by length (a long one does not pad short ones to its width),
first chunks apart from later ones. A group is right-padded to a shared width and runs as one
forward (short chunks, first or later, replay a graph captured at start-up): causal attention, so a
prompt's tokens never see the padding after them, whose keys lie past the chunk's end where
the next chunk or the first round writes over them. A chunk runs from its start: the invariant
prefill's windows attend over the keys cached before it, so the chunks compute what the whole
prompt would. The drafter takes a first chunk through ``prefill_rows`` and a later one as a
round's extension, from the features before it (the ring). A new request's prompt meets the
prefix cache first (prefix.py): the pages of the blocks it starts with are mapped into its table and the
rest prefilled as a later chunk. Completed prompts draw their first token and land as a round
of width 1; a chunk short of its prompt's end lands with no token (accepted -1).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch
import triton
from torch import Tensor

from draftline.core.contract import Capacity, DraftOverride, DraftRows
from draftline.core.machine import Plan
from draftline.core.methods.base import Drafter
from draftline.core.models.ops import Forward
from draftline.core.models.target import TargetModel
from draftline.core.request import Request
from draftline.core.sampling import Filters, SamplingBatch, Stream, probs_from_logits

from . import logprobs as target_logprobs
from . import sampling as kernels
from .beside import PrefillStream
from .buffers import Buffers, FeatureRing, draft_slot, host_inverse_temperature, inverse_temperature
from .graphs import Graphs
from .head import lm_logits
from .kv import FrozenTargetKV, Rows, StaticKV, StaticStore
from .landing import Landing, Launch
from .logprobs import Pending
from .masks import TokenMasks, apply_masks
from .ops import CudaOps
from .penalties import SlotPenalties
from .prefix import SAVE_COLS, STAGE_COLS, DevicePrefix
from .prices import PrefillPrices
from .staging import Staging
from .views import prefill_view


PREFILL_WIDTHS = (16, 32, 64, 128, 256)  # prompt widths whose prefill is captured, for every batch bucket
PREFILL_GRAPH_TOKENS = 8192  # at most this many (padded) prompt tokens per captured prefill
PREFILL_SLACK = 512  # padded tokens a prefill group may carry past twice its prompts' before it splits


AT, SLOTS, DRAFT_SLOTS, START, SEED, TOP_K, DONE = range(7)  # rows of PrefillView.cols
TEMPERATURE, TOP_P, INV_TEMP = range(3)  # rows of PrefillView.fcols


@dataclass(frozen=True)
class PrefillView:
    """What a prefill of (rows, width) reads, each a view of PrefillBuffers.raw, laid out as the
    host writes them (``offsets``) so that one copy moves them all: per chunk its columns, the
    padded chunks, and the prefix store's tables (prefix.py) for copies made inside the step."""

    # [7, rows] int64 per chunk: its length (a whole prompt's: the first token's position), KV
    # slot, drafter slot (the scratch slot where none), first position in its prompt (0: a first
    # chunk), seed, top-k, and whether it ends its prompt (1: its first token is drawn and placed)
    cols: Tensor
    fcols: Tensor  # [3, rows] float32: temperature, top-p, inverse temperature (0: greedy)
    counts: Tensor  # [2] int64: the rows of ``saves`` and ``stages`` the host filled
    ids: Tensor  # [rows, width] int64
    stages: Tensor  # [rows x (width // block + 1), STAGE_COLS] int64: features kept for the blocks a chunk ends
    saves: Tensor  # [the rest, SAVE_COLS] int64: blocks saved
    offsets: tuple[int, int, int, int, int]  # where fcols, counts, ids, stages and saves begin (int64 elements)

    at = property(lambda self: self.cols[AT])
    slots = property(lambda self: self.cols[SLOTS])
    draft_slots = property(lambda self: self.cols[DRAFT_SLOTS])
    start = property(lambda self: self.cols[START])
    done = property(lambda self: self.cols[DONE])


@dataclass
class PrefillBuffers:
    """One flat device buffer a prefill's inputs are copied into, whatever its shape, and its
    views by (rows, width), made once: a captured prefill reads the views it was captured with."""

    raw: Tensor  # [elements] int64
    block: int  # the prefix store's block (its tables' bound per chunk), 0: no prefix store
    views: dict[tuple[int, int], PrefillView]

    @staticmethod
    def make(max_batch: int, width: int, block: int, device: torch.device) -> "PrefillBuffers":
        per_row = 12 + width + (width // block + 1) * (STAGE_COLS + SAVE_COLS) if block else 12 + width
        return PrefillBuffers(torch.zeros(max_batch * per_row + 2, dtype=torch.int64, device=device), block, {})

    def view(self, rows: int, width: int) -> PrefillView:
        found = self.views.get((rows, width))
        return found if found is not None else self.views.setdefault((rows, width), self._view(rows, width))

    def _view(self, rows: int, width: int) -> PrefillView:
        stages = rows * (width // self.block + 1) if self.block else 0
        fcols = 7 * rows
        counts = fcols + -(-3 * rows // 2)
        ids = counts + 2
        staged = ids + rows * width
        saved = staged + stages * STAGE_COLS
        raw = self.raw
        return PrefillView(raw[:fcols].view(7, rows), raw[fcols:counts].view(torch.float32)[: 3 * rows].view(3, rows),
                           raw[counts:ids], raw[ids:staged].view(rows, width),
                           raw[staged:saved].view(stages, STAGE_COLS),
                           raw[saved : saved + (raw.shape[0] - saved) // SAVE_COLS * SAVE_COLS].view(-1, SAVE_COLS),
                           (fcols, counts, ids, staged, saved))


def _pick(value, rows: Tensor):
    """Rows ``rows`` of a tensor, or of each field of a SamplingBatch."""
    if isinstance(value, SamplingBatch):
        return SamplingBatch(**{f.name: getattr(value, f.name)[rows] for f in fields(value)})
    return value[rows]


def _as_rows_of(reported: list[Pending], rows: list[int]) -> list[Pending]:
    """Logprobs pending for a subset of a landing's rows, their row i (-1: every position kept)
    renamed to rows[i], the row it has in the whole landing."""
    return [replace(r, rows=tuple(rows[i] if i >= 0 else -1 for i in r.rows)) for r in reported]


def _prompt_logprobs(req: Request) -> bool:
    """Whether this prefill reports the prompt's logprobs (not again for a resumed request)."""
    return req.params.prompt_logprobs is not None and not req.recomputed


def _eager_tail(reqs: list[Request]) -> bool:
    """Whether a prefill's first tokens are drawn again eagerly over its logits: rows that
    filter, adjust or report logits, or report the prompt's logprobs."""
    return any(r.params.reads_logits or _prompt_logprobs(r) for r in reqs)


def filtered(reqs: list[Request]) -> bool:
    """Rows with top-k or top-p need the full probability pass; the rest sample from logits."""
    return any(r.params.top_k > 0 or r.params.top_p < 1 for r in reqs)


def draw_scores(logits: Tensor, reqs: list[Request], batch: SamplingBatch) -> tuple[Tensor, Tensor | None]:
    """What the sampling kernels draw from: log-probabilities after top-k/top-p when any row
    filters (inv_temp None), else the raw logits and each row's inverse temperature."""
    if filtered(reqs):
        return torch.log(probs_from_logits(logits, batch, Filters.of([r.params for r in reqs]))), None
    return logits, inverse_temperature(batch.temperature)


@dataclass(eq=False)
class Prefiller:
    """The cuda backend's prefill (the module's docstring), given the backend's parts it works
    with; it owns the prefill buffers, the short prefills' graphs and their prices, and the
    prefix cache's store."""

    target: TargetModel
    plan: Plan
    capacity: Capacity
    cache: StaticKV  # the target's KV: slots, pages, the scratch slot
    kv: StaticStore  # the drafter's caches
    drafter: Drafter | None
    ring: FeatureRing | None  # the last verified features, for drafters that read them
    ops: CudaOps
    bufs: Buffers  # the rounds' slot state, where first tokens are placed
    penalties: SlotPenalties
    landing: Landing
    beside: PrefillStream
    staging: Staging
    buckets: tuple[int, ...]  # the batch sizes graphs are captured for
    graphs: Graphs  # short prefills' graphs
    prices: PrefillPrices = field(default_factory=PrefillPrices)  # measured once the graphs are captured
    draft_override: DraftOverride | None = None  # admits each prompt (bench --acceptance)
    prefix_store: DevicePrefix | None = field(init=False)
    pre: PrefillBuffers = field(init=False)
    masks: TokenMasks = field(init=False)  # constrained prompts' first tokens (the rounds' masks are apart)

    def __post_init__(self) -> None:
        self.device = self.cache.data.device
        # the prefix cache: a hit's rest is prefilled as a later chunk, so it needs chunked prefill
        seeded = self.ring if getattr(self.drafter, "extends_from_features", False) else None  # a hit's chunk reads it
        block = self.capacity.prefix_block if self.chunked else 0
        self.prefix_store = DevicePrefix(block, self.cache, self.kv, seeded, self.staging) if block else None
        self.pre = PrefillBuffers.make(self.capacity.max_batch, self.cache.max_len, block, self.device)
        self.masks = TokenMasks(self.capacity.max_batch, 1, self.target.config.vocab_size, self.device)

    @property
    def chunked(self) -> bool:
        """Whether a prompt may be prefilled in chunks: through the invariant prefill, which attends
        over the cache (the library's whole-prompt attention sees only the tokens it is given)."""
        return self.cache.invariant

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def release(self, req: Request) -> None:
        """A finished request's hold on the prefix cache's blocks."""
        if self.prefix_store is not None:
            self.prefix_store.release(req)

    def capture(self) -> None:
        """Every short prefill's graph, for every bucket, over padding rows (the scratch slot:
        the draws place nothing); then their prices, measured."""
        for bucket in self.buckets:
            for width in PREFILL_WIDTHS:
                for later in (False, True):  # first chunks, and later ones (a prefix hit's rest)
                    if self._prefill_graphed(bucket, width, later):
                        self._pad_prefill(bucket, width)
                        self.graphs.run((bucket, width, later), lambda: self._prefill_step(bucket, width, None, later))
        self.prices = PrefillPrices.measure(self.graphs, self.landing.device_index,
                                            lambda key: self._pad_prefill(key[0], key[1]))

    @torch.inference_mode()
    def prefill(self, reqs: list[Request], ends: list[int] | None = None) -> Launch:
        """The admitted prompts in few forwards (_prefill_groups), each right-padded to a shared
        width (causal attention: a prompt's tokens never see the padding after them; the
        padding's keys lie past the prompt's length, where the first round writes over them),
        the drafter's entries for the prompts in the same pass. Short ones replay a graph
        captured at start-up for their (rows, width) bucket. One copy back for all. Where asked
        for, on a stream of its own beside the rounds (beside.py), but for rows that read
        logits or prompt logprobs (their eager tail is the rounds' stream's)."""
        if not self.beside.on:
            return self._prefill_launch(reqs, ends)
        if _eager_tail(reqs):
            self.beside.join_all()  # in line, after the prefills beside (a prefix block one saved)
            return self._prefill_launch(reqs, ends)
        with self.beside.run(reqs):
            return self._prefill_launch(reqs, ends)

    def _prefill_launch(self, reqs: list[Request], ends: list[int] | None) -> Launch:
        started = self.landing.started()  # the prefill's own device time (the round trace reads it)
        ends = [e if r.kv is not None else self._admit(r, e)
                for r, e in zip(reqs, ends or [r.prefill_len for r in reqs])]
        self.cache.flush()  # the admitted prompts' pages, before anything reads the table
        groups = self._prefill_groups(reqs, ends)
        if len(groups) == 1:
            packed, reported = self._prefill_group(reqs, ends)
            return self.landing.land(packed, 1, reported, started, span=False)
        # each group's result copied before the next group runs: a graph's output is rewritten by its next replay
        done = [(packed.clone(), reported) for packed, reported in
                (self._prefill_group([reqs[i] for i in g], [ends[i] for i in g]) for g in groups)]
        order = self.staging.put(torch.tensor([i for g in groups for i in g]))
        packed = torch.empty(len(reqs), 3, dtype=torch.int64, device=self.device)
        packed[order] = torch.cat([p for p, _ in done])
        reported = [r for g, (_, group_reported) in zip(groups, done) for r in _as_rows_of(group_reported, g)]
        return self.landing.land(packed, 1, reported, started, span=False)

    def _admit(self, req: Request, end: int) -> int:
        """A new request's slots, the prefix cache's pages its prompt starts with mapped into its
        table line -> where its first prefill ends (past what the cache gave: at least one token)."""
        req.kv = self.cache.allocate()
        if self._caches(req):
            req.prefilled = self.prefix_store.restore(req)
            req.cached_tokens = req.cached_tokens if req.recomputed else req.prefilled  # the first admission's
        if req.rid >= 0:  # paged KV: the prompt's pages (start-up's warm-up prompts write the scratch page)
            self.cache.reserve(req.kv, req.prefill_len + self.capacity.kv_lookahead)
        if self.drafter is not None:
            with self.kv.bound(req.kv):  # a paged drafter cache's row is the target's
                self.drafter.admit(req)
        if self.draft_override is not None and req.rid >= 0:
            self.draft_override.admit(req.kv, req.prompt_ids)
        return max(end, req.prefilled + 1)

    def _caches(self, req: Request) -> bool:
        """Whether the request meets the prefix cache: not one asking prompt_logprobs (every
        position's logits), nor start-up's warm-up prompts."""
        return self.prefix_store is not None and req.params.prompt_logprobs is None and req.rid >= 0

    def _prefill_groups(self, reqs: list[Request], ends: list[int]) -> list[list[int]]:
        """Indices of ``reqs`` in groups prefilled together: prompts' first chunks apart from
        later chunks (the drafter takes those as a round's extension), each by length, a group
        closed where the next chunk would pad it past twice its tokens (and PREFILL_SLACK), so
        one long prompt does not pad thirty short ones to its width; then each group split where
        the graphs' measured prices say its padded rows cost more than more launches (_priced)."""
        groups: list[list[int]] = []
        for later in (False, True):
            chunks = [i for i in range(len(reqs)) if (reqs[i].prefilled > 0) == later]
            real, latest, group = 0, 0, []
            for i in sorted(chunks, key=lambda i: ends[i] - reqs[i].prefilled):
                size, start = ends[i] - reqs[i].prefilled, reqs[i].prefilled
                # the group's width must hold every chunk past the latest start in the cache
                rows, width = self._prefill_shape(len(group) + 1, size, self.cache.max_len - max(latest, start))
                if group and (width < size or rows * width > 2 * (real + size) + PREFILL_SLACK):
                    groups += self._priced(group, reqs, ends, later)
                    real, latest, group = 0, 0, []
                group.append(i)
                real, latest = real + size, max(latest, start)
            groups += self._priced(group, reqs, ends, later) if group else []
        return groups

    def _priced(self, group: list[int], reqs: list[Request], ends: list[int], later: bool) -> list[list[int]]:
        """``group`` (by chunk size) in the forwards whose measured graphs cost least (prices.py):
        17 prompts as 8, 8 and 1 rather than padded to 32 rows where the forward is arithmetic-bound.
        Only with the invariant kernels, whose rows compute alike however they are grouped: the
        other kernels' results follow the grouping, which must not follow start-up's timings."""
        if not self.cache.invariant:
            return [group]
        sizes = [ends[i] - reqs[i].prefilled for i in group]
        width = self._prefill_shape(len(group), max(sizes), self.cache.max_len - max(reqs[i].prefilled for i in group))[1]
        pieces, at = [], 0
        for rows in self.prices.pieces(len(group), width, later):
            pieces.append(group[at : at + rows])
            at += rows
        return pieces

    def _prefill_group(self, reqs: list[Request], ends: list[int]) -> tuple[Tensor, list]:
        """One forward over each request's prompt from where it stands to its end: (packed [n, 3]
        as a round of width 1 lands, logprobs pending). A chunk short of its prompt's end lands
        with accepted -1: no token."""
        n, starts = len(reqs), [r.prefilled for r in reqs]
        for req, end in zip(reqs, ends):
            req.prefilled = end
        chunks = [r.prefill_ids[s:e] for r, s, e in zip(reqs, starts, ends)]
        rows, width = self._prefill_shape(n, max(map(len, chunks)), self.cache.max_len - max(starts))
        if width < max(map(len, chunks)):  # _prefill_groups keeps every chunk within its group's room
            raise RuntimeError(f"prefill: a {max(map(len, chunks))}-token chunk in a group {width} wide")
        # every position's hidden states for prompt_logprobs (a resumed request's were reported)
        hidden = [] if any(_prompt_logprobs(r) for r in reqs) else None
        ending = [e >= r.prefill_len for r, e in zip(reqs, ends)]  # chunks that end their prompts
        v = self._load_prefill(reqs, chunks, starts, ending, rows, width)
        later = any(starts)  # later chunks (a prefix hit's rest among them) have graphs of their own
        logits, features, packed = self.graphs.run((rows, width, later),
                                                           lambda: self._prefill_step(rows, width, None, later)) \
            if self._prefill_graphed(rows, width, later) and hidden is None \
            else self._prefill_step(rows, width, hidden, later)
        if not _eager_tail(reqs):
            return packed[:n], []  # the step drew and placed them as plain decoding would
        logits, packed, done = logits[:n], packed[:n], [i for i, last in enumerate(ending) if last]
        # the eager tail's parameters, copied out: a copy is aligned whatever the row count
        batch = SamplingBatch(temperature=v.fcols[TEMPERATURE, :n].clone(), top_k=v.cols[TOP_K, :n].clone(),
                              top_p=v.fcols[TOP_P, :n].clone(), seed=v.cols[SEED, :n].clone())
        rows_in = (logits, batch, v.start[:n] + v.at[:n], v.slots[:n], hidden[0] if hidden else None, v.ids[:n])
        if len(done) == n:
            return self._first_tokens(reqs, *rows_in)
        if not done:
            return packed, []  # every chunk short of its prompt's end: finite, no token
        packed = packed.clone()
        pick = self.staging.put(torch.tensor(done))
        first, reported = self._first_tokens([reqs[i] for i in done], *(None if t is None else _pick(t, pick)
                                                                         for t in rows_in))
        packed[pick] = first
        return packed, _as_rows_of(reported, done)

    def _load_prefill(self, reqs: list[Request], chunks: list[list[int]], starts: list[int], ending: list[bool],
                      rows: int, width: int) -> PrefillView:
        """The chunks, right-padded to ``width``, their columns and the prefix store's tables
        (prompts that end here: their blocks, into its index now) into the prefill buffers in
        one copy -> the view the step reads; padding rows (to ``rows``) prefill one token in the
        scratch slot and end nothing."""
        scratch, n, v = self.cache.scratch, len(reqs), self.pre.view(rows, width)
        stages = saves = None
        if self.prefix_store is not None:
            stages = self.prefix_store.stages([r.kv for r in reqs], starts, [s + len(c) for s, c in zip(starts, chunks)])
            saves = self.prefix_store.saves([r for r, last in zip(reqs, ending) if last and self._caches(r)])
            if saves.shape[0] > v.saves.shape[0] or stages.shape[0] > v.stages.shape[0]:
                raise RuntimeError(f"prefill: {saves.shape[0]} blocks saved, {stages.shape[0]} staged, past the tables")
        fcols, counts, ids, staged, saved = v.offsets
        flat = np.zeros(saved + (0 if saves is None else saves.size), dtype=np.int64)  # what the view reads, in order
        cols, padded = flat[:fcols].reshape(7, rows), flat[ids:staged].reshape(rows, width)
        for i, c in enumerate(chunks):
            padded[i, : len(c)] = c
        if reqs:
            cols[:, :n] = np.array([(len(c), r.kv, draft_slot(r.draft_state, scratch), s, r.params.seed, r.params.top_k,
                                     last) for r, c, s, last in zip(reqs, chunks, starts, ending)], dtype=np.int64).T
        cols[:, n:] = np.array([1, scratch, scratch, 0, 0, -1, 0], dtype=np.int64)[:, None]  # padding: one token in the scratch slot
        floats = flat[fcols:counts].view(np.float32)[: 3 * rows].reshape(3, rows)  # [TEMPERATURE, TOP_P, INV_TEMP]
        floats[TEMPERATURE, :n] = [r.params.temperature for r in reqs]
        floats[TOP_P, :n] = [r.params.top_p for r in reqs]
        floats[:2, n:] = ((0.0,), (1.0,))
        floats[INV_TEMP] = host_inverse_temperature(floats[TEMPERATURE])
        if saves is not None:
            flat[counts : counts + 2] = saves.shape[0], stages.shape[0]
            flat[staged : staged + stages.size] = stages.ravel()
            flat[saved:] = saves.ravel()
        self.staging.put_into(self.pre.raw, flat)
        return v

    def _pad_prefill(self, rows: int, width: int) -> None:
        """Every row of a (rows, width) prefill a padding row of token 0, nothing to save: what
        start-up's captures and timings run over (the views of other shapes share the buffer,
        so what it held may be anything)."""
        self._load_prefill([], [], [], [], rows, width)

    def _first_draws(self, p: PrefillView, logits: Tensor) -> Tensor:
        """Each chunk's first token as plain decoding draws it (rows that filter, adjust or report
        logits are drawn again by _first_tokens), placed in its slot where the chunk ends its
        prompt, and its sampling parameters kept in its slot -> packed [rows, 3] as a round of
        width 1 lands: finite, accepted (0; -1 for a chunk short of its prompt's end, which draws
        nothing), the token."""
        at, done = p.start + p.at, p.done == 1
        tokens = kernels.sample(torch.nan_to_num(logits), p.cols[SEED], at, Stream.SAMPLE, inv_temp=p.fcols[INV_TEMP])
        self.bufs.place(p.slots, tokens, at, done & (p.slots != self.cache.scratch))
        self.bufs.remember(p.slots, p.cols[SEED : TOP_K + 1], p.fcols)  # its rounds gather them
        finite = torch.isfinite(logits).all(dim=1) | ~done
        return torch.stack([finite.long(), done.long() - 1, torch.where(done, tokens, 0)], dim=1)

    def _first_tokens(self, reqs: list[Request], logits: Tensor, batch: SamplingBatch, at: Tensor, slots: Tensor,
                      hidden: Tensor | None, ids: Tensor) -> tuple[Tensor, list]:
        """Completed prompts' first tokens from their last positions' logits [n, V], at positions
        ``at`` [n], placed in their slots -> (packed [n, 3], logprobs pending)."""
        finite = torch.isfinite(logits).all(dim=1)
        self.penalties.admit(reqs)
        adjusted = self.penalties.adjust(logits[:, None], reqs, at - 1, None)  # as the reference: then nan_to_num
        adjusted = self._masked(adjusted, reqs)[:, 0]
        scores, inv_temp = draw_scores(torch.nan_to_num(adjusted), reqs, batch)
        tokens = kernels.sample(scores, batch.seed, at, Stream.SAMPLE, inv_temp=inv_temp)
        self.bufs.place(slots, tokens, at)
        self.penalties.count(reqs, tokens[:, None], None)
        reported = self._prompt_logprobs(reqs, hidden, ids)
        reported += target_logprobs.pending(reqs, logits[:, None], tokens[:, None], at)
        # as a round of width 1 lands: finite, accepted (0), the token; read when collected
        return torch.stack([finite.long(), torch.zeros_like(tokens), tokens], dim=1), reported

    def _masked(self, logits: Tensor, reqs: list[Request]) -> Tensor:
        """logits [n, 1, V] with each constrained request's grammar applied (a float32 copy: the
        raw ones are read for logprobs), all its masks in one copy and one launch; as they are
        when no request is constrained."""
        if not any(r.grammar is not None for r in reqs):
            return logits
        out = logits.to(torch.float32, copy=True).contiguous()
        self.masks.load(reqs, None, len(reqs), 1)
        apply_masks(out, self.masks.view(len(reqs), 1))
        return out

    def _prompt_logprobs(self, reqs: list[Request], hidden: Tensor | None, ids: Tensor) -> list:
        """prompt_logprobs: each such prompt's positions 0 .. P-2 (hidden [n, width, H], ids [n, width];
        the ids copied: a view of the prefill buffer would be rewritten by the step's next group
        before the readout's copy to the host, which the landing starts after every group)."""
        if hidden is None:
            return []
        return [target_logprobs.prompt(r, hidden[i, : len(r.prompt_ids) - 1], ids[i, 1 : len(r.prompt_ids)].clone(),
                                       self.target.logits)
                for i, r in enumerate(reqs) if _prompt_logprobs(r) and len(r.prompt_ids) > 1]

    def _prefill_graphed(self, rows: int, width: int, later: bool = False) -> bool:
        return (self.graphs.enabled and width in PREFILL_WIDTHS and rows * width <= PREFILL_GRAPH_TOKENS
                and width <= self.cache.max_len and (self.chunked or not later))

    def _prefill_step(self, rows: int, width: int, hidden_out: list | None = None, later: bool = False
                      ) -> tuple[Tensor, Tensor | None, Tensor]:
        """The target over the prefill buffers' first ``rows`` chunks of ``width`` tokens, each
        from its start: keys stored in their slots -> (logits at each chunk's last token [rows,
        V], taps). ``hidden_out`` (eager only) receives every position's hidden states, for
        prompt_logprobs. ``later``: chunks past their prompts' first, which the drafter takes as
        a round's extension (from the features before them, in the ring). Also each chunk's
        first token as plain decoding draws it, placed (_first_draws: packed [rows, 3]); then the
        prefix store's copies its tables name (features kept, prompts' blocks saved)."""
        with self.cache.prefills_apart(), self.kv.prefills_apart():  # beside the rounds: tickets apart
            return self._prefill_forward(rows, width, hidden_out, later)

    def _prefill_forward(self, rows: int, width: int, hidden_out: list | None, later: bool
                         ) -> tuple[Tensor, Tensor | None, Tensor]:
        p = self.pre.view(rows, width)
        positions = p.start[:, None] + torch.arange(width, device=self.device)[None]  # [rows, P]
        cfg = self.target.config
        view = prefill_view(self.cache, p.slots, width, cfg.num_heads // cfg.num_kv_heads, p.start if later else None)
        fwd = Forward(positions, view, self.plan.target_layer_ids, invariant=self.cache.invariant)
        hidden, features = self.target.run(self.ops, fwd, p.ids)
        if hidden_out is not None:
            hidden_out.append(hidden)
        if self.drafter is not None and later:
            self.drafter.extend_rows(self._draft_rows(p, rows, later, positions), features, p.ids)
        elif self.drafter is not None:
            self.drafter.prefill_rows(self._draft_rows(p, rows, later, positions), features, p.ids)
        ends = torch.arange(rows, device=self.device), p.at - 1
        if self.ring is not None:  # a chunk's last features: the next chunk's, or the first round's
            self.ring.write(p.slots, p.start + ends[1], features[ends][:, None])
        last = hidden[ends]  # [rows, H]
        # the first token as a verify row would draw it, whatever the batch (invariant)
        logits = lm_logits(self.target.lm_head, last, True) if self.cache.invariant else self.target.logits(last)
        packed = self._first_draws(p, logits)
        if self.prefix_store is not None:
            self.prefix_store.copy(p.saves, p.stages, p.counts, features)
        return logits, features, packed

    def _draft_rows(self, p: PrefillView, rows: int, later: bool, positions: Tensor | None = None) -> DraftRows:
        """The chunks' rows as a drafter sees them, from each chunk's start (0 for first chunks);
        ``later`` chunks as a round's extension, with the features before them from the ring
        (the last chunk's last)."""
        features = self.ring.read(p.slots, p.start, shift=-1) if later and self.ring is not None else None
        return DraftRows(last_token=p.ids[:, 0], start=p.start, batch=self.bufs.sampling(rows),
                         caches=Rows(p.draft_slots), target_kv=FrozenTargetKV(self.cache, p.slots, p.start),
                         features=features, positions=positions)

    def _prefill_shape(self, n: int, longest: int, room: int | None = None) -> tuple[int, int]:
        """(rows, width) to prefill n prompts at: a batch bucket, and a width in few sizes
        (powers of two to 256, then multiples of 256), so graphs and the matrix library see
        shapes they have seen, within ``room`` (the cache's positions past the latest start)."""
        width = max(16, triton.next_power_of_2(longest)) if longest <= 256 else triton.cdiv(longest, 256) * 256
        return self.bucket(n), min(width, self.cache.max_len if room is None else room)
