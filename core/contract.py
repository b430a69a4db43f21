"""The contract between the machine, the backends and the methods' drafters: the Backend
protocol the machine drives (prefill, launch a round, collect its result, free) and the types
the backends and the methods share. Core defines it; backends implement it; core imports no
backend."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from draftline.core.models.ops import Forward, Ops
from draftline.core.request import Request
from draftline.core.sampling import Filters, SamplingBatch


@dataclass(frozen=True)
class Capacity:
    """What a backend sizes its persistent state by."""

    max_batch: int  # requests running at once (server.max_batch_size)
    max_model_len: int  # prompt + output tokens of one request
    graphs: bool = True  # capture CUDA graphs where the backend can
    invariant: bool = False  # a target row's results independent of the rows beside it (model.batch_invariant)
    invariant_required: bool = False  # the spec set it: a backend that cannot keep it refuses to start
    prefix_block: int = 0  # tokens a prefix-cache block (server.block_size); 0: no prefix caching
    kv_pages: int = 0  # paged KV: blocks in the target's pool (server.num_kv_blocks); 0: a whole context a slot
    kv_page: int = 16  # tokens a KV block (server.block_size)
    kv_lookahead: int = 0  # positions past its booked length a request's rounds in flight may write (BlockPool)
    kv_memory: float = 0.0  # paged KV sized to this share of the GPU's memory (server.gpu_memory_utilization)


@dataclass(frozen=True)
class Proposal:
    """A round's drafts for every running request."""

    tokens: Tensor  # [N, K] int64
    probs: Tensor | None = None  # [N, K, V] the drafter's q, or None for argmax drafts
    # [N, K, V] float32: the drafter's logits at each slot over the target's vocabulary, where the
    # rows asked for them (DraftRows.scores): a grammar chooses a constrained row's drafts again
    scores: Tensor | None = None

    def rows(self, keep: list[int]) -> "Proposal":
        return Proposal(*(None if t is None else t[keep] for t in (self.tokens, self.probs, self.scores)))

    def first(self, k: int) -> "Proposal":
        """The first k drafts of every row (a narrower verify)."""
        if k >= self.tokens.shape[1]:
            return self
        return Proposal(*(None if t is None else t[:, :k] for t in (self.tokens, self.probs, self.scores)))


@dataclass(frozen=True)
class Verification:
    logits: Tensor  # [N, K+1, V] float32 target logits at the last token and each draft
    features: Tensor | None  # [N, K+1, n*H] tapped target hidden states, if the plan taps any
    finite: Tensor | None = None  # [N] bool on the host: all of the row's logits finite (None: not yet known)

    def rows(self, keep: list[int]) -> "Verification":
        return Verification(self.logits[keep], None if self.features is None else self.features[keep],
                            None if self.finite is None else self.finite[keep])


@dataclass(frozen=True)
class DraftRows:
    """The rows a drafter drafts for, as device tensors: what a graph-captured draft step reads."""

    last_token: Tensor  # [N] int64, the token each row's round starts from
    start: Tensor  # [N] int64, its position (seq_len - 1)
    batch: SamplingBatch  # per-row sampling parameters
    caches: Any  # the KVStore's handle on these rows' drafter caches
    target_kv: "TargetKV | None" = None  # the target's own cache, read-only (drafters that share it)
    features: Tensor | None = None  # [N, taps*H] target features at position start - 1 (Drafter.reads_last_features)
    drafts: int = 0  # drafts the round verifies (a narrower verify; 0: K): a drafter may propose only those
    # [N, W] int64: the positions start .. start + W - 1 of the window extend_rows (prefill_rows) is
    # given, where the backend has them on the device already (its verify's, its prefill's); else
    # a drafter that needs them makes them
    positions: Tensor | None = None
    end: Tensor | None = None  # [N] int64: start + W, that window's key count, where the backend has it
    greedy: bool = False  # every row greedy (temperature 0): a draw from the drafter's q is its argmax
    scores: bool = False  # keep the drafter's logits in the proposal (Proposal.scores): some row is constrained
    # the batch's sampling passes as the host knows them, so drawing from q waits for nothing
    # (a captured draft step cannot wait); None: read off rows.batch
    filters: Filters | None = None

    def argmax_drafts(self, draft_sample_method: str) -> bool:
        """Whether the drafts are the drafter's argmax: the plan drafts greedily, or every row is
        greedy, where sampling from q picks its argmax (the argmax path skips q and the draw)."""
        return self.greedy or draft_sample_method == "greedy"

    def verified(self, k: int) -> int:
        """The drafts the round verifies, at most K: the steps a chain runs, the block slots a
        block drafter reads out."""
        return min(k, self.drafts) if self.drafts > 0 else k


class DraftOverride(Protocol):
    """Replaces a draft step's drafts (core/simulated.SimulatedAcceptance, for bench
    --acceptance): ``admit`` learns a prompt's slot, ``__call__`` rewrites the drafts in place."""

    def admit(self, slot: int, prompt_ids: list[int]) -> None: ...

    def __call__(self, slots: Tensor, start: Tensor, drafts: Tensor) -> None: ...


class TargetKV(Protocol):
    """Read-only access to the target's KV cache for the rows of a draft step."""

    def forward(self, positions: Tensor, layer: int) -> Forward:
        """A forward of queries at positions [N, W] that reads each row's verified keys of target
        layer ``layer`` (positions 0 .. start - 1), with no mask among them, whatever layer of
        its own reads them; nothing is stored."""


class KVStore(Protocol):
    """The caches a backend lends to drafters that own one, and the operations their forwards
    run with. ``positional`` stores (the cuda backend's) keep a key at its absolute position
    in a row's slot, written through rows (``forward`` of DraftRows.caches); the others (the
    reference's) append to per-request handles (``forward`` of a list of ``new()`` handles)."""

    ops: Ops
    positional: bool

    def new(self, num_layers: int) -> Any: ...

    def forward(self, caches: Any, positions: Tensor, causal: bool, persist: bool = True,
                windows: dict[int, int] | None = None, anchor: Any = None, block_causal: bool = False,
                per_query: bool = False, end: Tensor | None = None) -> Forward:
        """A drafter forward whose new keys are each row's at ``positions`` [N, W] (a positional
        store's; an append store's go at each handle's end, kept where ``persist``), attending over
        the row's cache then the new keys: ``causal`` or not (a DFlash block). ``windows``
        (layer -> sliding window) limits those layers' keys: causal, to the window ending at each
        query or, past ``anchor`` (a position; a positional store: one per row [N]), at the
        anchor; non-causal, to the last ``window`` positions before the block (``block_causal``:
        the block causal too) or, ``per_query``, to the window ending at each query, causally
        (backends/reference/kv.py: attend). ``end`` [N]: each row's key count after the forward
        (positions[:, -1] + 1), where the caller has it on the device."""

    def prefill(self, caches: Any, positions: Tensor, windows: dict[int, int] | None = None) -> Forward:
        """A positional store's forward over the rows' first entries, at positions 0 .. T - 1:
        causal among each row's own new keys (a batched prefill's)."""

    def truncate(self, cache: Any, length: int) -> None:
        """An append store's handle cut back to its first ``length`` entries."""


@dataclass(frozen=True)
class RoundResult:
    """What a collected round means, row by row, in the order the round was launched with.
    A backend reports what its device decided; the machine decides what it means (stops)."""

    finite: list[bool]  # every logit of the row's verify window was finite
    accepted: list[int]  # drafts accepted
    tokens: list[list[int]]  # accepted + 1 tokens: the accepted drafts, then the correction or bonus
    drafted: list[list[int]]  # the round's K drafts (empty lists for a round that did not draft)
    # the round's own time on the device, where the backend times it (None: the machine times the
    # round by the wall clock, which on a shared host also reads whatever held the host back)
    device_s: float | None = None
    # where the launch's device work began on the backend's own device clock, in seconds (None:
    # not timed): beside the host's launch times, the round trace's device timeline
    device_at: float | None = None


def narrowing_widths(k: int) -> tuple[int, ...]:
    """Verify widths a drafting round may take with K drafts: K + 1, then halving down to 2
    (K = 15: 16, 8, 4, 2). Later drafts are the least likely accepted, and past the batch size
    where the verify turns compute-bound each costs as much as the first."""
    out, w = [], k + 1
    while w >= 2 and w not in out:
        out.append(w)
        w = (w + 1) // 2
    return tuple(out)


class Backend(Protocol):
    """Runs rounds for the machine. ``launch`` enqueues one round for the given rows (this
    round's draft, its verify and the acceptance, on the device) and returns at once with a
    handle; ``collect`` waits for that round's result (one small copy). A round starts from
    where the device left each row: after its prefill, or after the last round launched for
    it, collected or not. So the machine may launch up to ``max_depth`` further rounds for a
    row before collecting the first (0: the backend runs rounds synchronously). A backend
    with ``prefill_beside`` runs prefills concurrently with the rounds launched after them, so
    the machine launches a prefilled row's first round in a later step than its prefill."""

    name: str
    max_depth: int
    prefill_beside: bool

    def prepare(self) -> dict[str, Any]:
        """Start-up work (graph capture for every batch bucket); returns what it did and how long."""

    def prefill(self, reqs: list[Request], ends: list[int]) -> Any:
        """Enqueue the target over each prompt from ``req.prefilled`` to its end this step and
        prime the drafter; sets ``req.prefilled``; returns at once with a handle that
        ``collect`` turns into each first token (a RoundResult of one token per row whose
        prompt is done, none for a row part-way, nothing drafted). Rounds may be launched for
        the rows done before it is collected. A backend whose ``chunked_prefill`` is false
        gets whole prompts only."""

    def verify_widths(self, rows: int) -> tuple[int, ...]:
        """The drafting rounds' verify widths it runs for ``rows`` rows, widest (K + 1) first:
        a narrower one verifies only the round's first drafts (narrowing_widths)."""

    def launch(self, reqs: list[Request], width: int, then: int | None = None) -> Any:
        """Enqueue one round for ``reqs`` verifying ``width`` tokens a row: the last token and the
        first width - 1 of K drafts (1: a plain decode step). A backend may run a round wider
        than asked (the drafts a row reports say what it ran), never narrower. ``then``: the
        width the rows' next round will verify, where the machine has chosen it already (a
        backend that starts the next round's work behind this one starts it at that width)."""

    def collect(self, handle: Any) -> RoundResult:
        """Wait for a launched round (or a prefill) and return what it decided."""

    def free(self, req: Request) -> None: ...
