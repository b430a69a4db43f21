"""The reference backend: plain eager PyTorch, the definition of correct output.

The target runs one request at a time, so a request computes with the same shapes alone or
in any batch and its tokens never depend on its neighbours; sampling, acceptance and the
drafter run batched. Rounds run synchronously: ``launch`` does the whole round (draft, verify,
accept) and ``collect`` hands back what it decided.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftline.core import logprobs
from draftline.core.contract import Capacity, DraftRows, Proposal, RoundResult, Verification, narrowing_widths
from draftline.core.machine import Plan
from draftline.core.methods.base import Drafter, Method
from draftline.core.models.eager import EAGER
from draftline.core.models.ops import Forward
from draftline.core.models.shard import ops_for
from draftline.core.models.target import TargetModel
from draftline.core.walk import chosen, masked
from draftline.core.penalties import adjust_logits
from draftline.core.request import Request
from draftline.core.sampling import Filters, SamplingBatch, Stream, Verdict, accept_drafts, probs_from_logits, sample

from draftline.core.prefix import Block, PrefixCache

from .kv import FrozenTargetKV, ReferenceKV


@dataclass(frozen=True)
class BlockKV:
    """What the prefix cache keeps of a block: the target's keys and values at its positions,
    and the target's tapped features there (a drafter's state is rebuilt from them)."""

    k: list[torch.Tensor]  # per layer [Hkv, B, D]
    v: list[torch.Tensor]
    features: torch.Tensor | None  # [B, taps*H]


class ReferenceBackend:
    name = "reference"
    chunked_prefill = True  # a prompt may be prefilled in chunks over several steps
    features = frozenset({"penalties", "logprobs", "prompt_logprobs", "structured"})  # everything SamplingParams asks
    max_depth = default_depth = 0  # synchronous: a round reads the request as the host booked it
    prefill_beside = False

    def __init__(self, target: TargetModel, method: Method, plan: Plan, device: torch.device, dtype: torch.dtype,
                 capacity: Capacity | None = None):  # contiguous per-request caches grow as needed
        self.target, self.plan, self.device = target, plan, device
        self.kv = ReferenceKV(ops_for(target, EAGER))  # a tensor-parallel shard's ops all-reduce
        self.drafter: Drafter | None = method.build_drafter(plan, target, self.kv, device, dtype)
        self._last_features: dict[int, torch.Tensor] = {}  # rid -> [taps*H] at its last verified position
        self._chunks: dict[int, list[torch.Tensor]] = {}  # rid -> features of its prompt's chunks so far
        size = capacity.prefix_block if capacity is not None else 0
        # the same tokens as the running requests could hold: max_batch x max_model_len
        self.prefix = PrefixCache(size, capacity.max_batch * capacity.max_model_len // size) if size else None

    def prepare(self) -> dict:
        return {"graphs": 0, "seconds": 0.0}

    def verify_widths(self, rows: int) -> tuple[int, ...]:
        return narrowing_widths(self.plan.num_speculative_tokens) if self.drafter is not None else ()

    def launch(self, reqs: list[Request], width: int, then: int | None = None) -> RoundResult:
        proposal = self.draft(reqs, width - 1) if width > 1 else self.skip_draft(reqs)
        verification = self.verify(reqs, proposal)
        finite = torch.isfinite(verification.logits).flatten(1).all(dim=1).tolist()
        keep = [i for i, ok in enumerate(finite) if ok]  # a failed row is ended by the machine, not accepted
        k = proposal.tokens.shape[1]
        accepted, tokens = [0] * len(reqs), [[] for _ in reqs]
        if keep:
            kept = [reqs[i] for i in keep]
            verdict = self.accept(kept, proposal.rows(keep), verification.rows(keep))
            for j, i in enumerate(keep):
                accepted[i] = int(verdict.num_accepted[j])
                tokens[i] = verdict.tokens[j, : accepted[i] + 1].tolist()
        return RoundResult(finite=finite, accepted=accepted, tokens=tokens,
                           drafted=proposal.tokens.tolist() if k else [[] for _ in reqs])

    def collect(self, handle: RoundResult) -> RoundResult:
        return handle

    def _batch(self, reqs: list[Request]) -> SamplingBatch:
        return SamplingBatch.of([r.params for r in reqs], self.device)

    @torch.inference_mode()
    def prefill(self, reqs: list[Request], ends: list[int] | None = None) -> RoundResult:
        ends = ends or [r.prefill_len for r in reqs]
        outs = [self._prefill_one(req, end) for req, end in zip(reqs, ends)]
        done = [i for i, out in enumerate(outs) if out is not None]  # prompts this step completes
        first = self._first_tokens([reqs[i] for i in done], [outs[i] for i in done]) if done else ([], [])
        finite, tokens = [True] * len(reqs), [[] for _ in reqs]
        for j, i in enumerate(done):
            finite[i], tokens[i] = first[0][j], [first[1][j]]
        return RoundResult(finite=finite, accepted=[0] * len(reqs), tokens=tokens, drafted=[[] for _ in reqs])

    def _first_tokens(self, reqs: list[Request], last_logits: list[torch.Tensor]) -> tuple[list[bool], list[int]]:
        """Each completed prompt's first token from the logits at its last position."""
        batch, logits = self._batch(reqs), torch.stack(last_logits)  # [N, V]
        finite = torch.isfinite(logits).all(dim=1).tolist()
        adjusted = masked(adjust_logits(logits[:, None], reqs, None), reqs, None)[:, 0]  # [N, V]
        probs = probs_from_logits(torch.nan_to_num(adjusted), batch)
        at = torch.tensor([r.prefill_len for r in reqs], device=self.device)
        tokens = sample(probs, batch.seed, at, Stream.SAMPLE)
        for i, req in enumerate(reqs):
            if req.params.logprobs is not None:
                logprobs.record(req.logprobs, req.seq_len, logits[i : i + 1], tokens[i : i + 1], req.params.logprobs)
        return finite, tokens.tolist()

    def _prefill_one(self, req: Request, end: int) -> torch.Tensor | None:
        """The prompt through the target from where it stands to ``end`` (a first chunk starts
        after the blocks the prefix cache holds of it; the last token always runs) -> the
        logits at its last token [V] once the prompt is done, else None; then the drafter's
        state from every prompt position's features, the cached ones included."""
        if req.prefilled == 0:
            req.kv = self.kv.new(self.target.config.num_layers)
            blocks = self._cached(req)
            if blocks:
                for layer in range(self.target.config.num_layers):
                    self.kv.append(req.kv, layer, torch.cat([b.payload.k[layer] for b in blocks], dim=1),
                                   torch.cat([b.payload.v[layer] for b in blocks], dim=1))
            req.prefilled = sum(len(b.tokens) for b in blocks)
            req.cached_tokens = req.cached_tokens if req.recomputed else req.prefilled  # the first admission's
            self._chunks[req.rid] = [b.payload.features for b in blocks if b.payload.features is not None]
        start, end = req.prefilled, max(end, req.prefilled + 1)
        ids = torch.tensor([req.prefill_ids[start:end]], device=self.device)  # [1, end - start]
        positions = torch.arange(start, end, device=self.device)[None]
        hidden, features = self._target(req, ids, positions)
        req.prefilled = end
        if features is not None:
            self._chunks[req.rid].append(features[0])
        if req.params.prompt_logprobs is not None and not req.recomputed:  # t's logits predict t + 1 (whole prompts)
            logprobs.record(req.logprobs, 1, self.target.logits(hidden[0, :-1]), ids[0, 1:], req.params.prompt_logprobs)
        if end < req.prefill_len:
            return None
        chunks = self._chunks.pop(req.rid)
        feats = torch.cat(chunks) if chunks else None
        self._keep_blocks(req, list(req.prefix_blocks), feats)
        if self.drafter is not None:
            self._keep_last(req, None if feats is None else feats[-1])
            self.drafter.extend(req, feats, 0)
        return self.target.logits(hidden[0, -1])

    def _caches(self, req: Request) -> bool:
        """Whether this request's prompt meets the prefix cache: not one asking prompt_logprobs,
        which need every position's logits."""
        return self.prefix is not None and req.params.prompt_logprobs is None

    def _cached(self, req: Request) -> list[Block]:
        """The prefix cache's blocks this prompt starts with (pinned: free() releases them)."""
        if not self._caches(req):
            return []
        req.prefix_blocks = self.prefix.lookup(req.prefill_ids, req.prefill_len - 1)
        return list(req.prefix_blocks)

    def _keep_blocks(self, req: Request, cached: list[Block], feats: torch.Tensor | None) -> None:
        """Cache the prompt's full blocks past the ones it found (the KV just computed)."""
        if not self._caches(req):
            return
        size, parent, ids = self.prefix.block_size, cached[-1] if cached else None, req.prefill_ids
        for i in range(len(cached), len(ids) // size):
            at = slice(i * size, (i + 1) * size)
            payload = BlockKV([k[:, at].clone() for k in req.kv.k], [v[:, at].clone() for v in req.kv.v],
                              None if feats is None else feats[at].clone())
            parent = self.prefix.insert(parent, tuple(ids[at]), payload)
            if parent is None:  # the cache is full of pinned blocks, or the block is cached already
                return
            req.prefix_blocks.append(parent)

    @torch.inference_mode()
    def draft(self, reqs: list[Request], drafts: int = 0) -> Proposal:
        """K drafts a row, or the first ``drafts`` (a narrower verify)."""
        if self.drafter is None:
            return self.skip_draft(reqs)
        proposal = self.drafter.propose(reqs, self.draft_rows(reqs, drafts)).first(drafts or self.plan.num_speculative_tokens)
        return chosen(reqs, proposal)  # a constrained row's drafts chosen under its grammar

    def draft_rows(self, reqs: list[Request], drafts: int = 0) -> DraftRows:
        filters = Filters.of([r.params for r in reqs])
        return DraftRows(
            last_token=torch.tensor([r.last_token for r in reqs], device=self.device),
            start=torch.tensor([r.seq_len - 1 for r in reqs], device=self.device),
            batch=self._batch(reqs),
            caches=[r.draft_state for r in reqs],
            target_kv=FrozenTargetKV([r.kv for r in reqs], getattr(self.kv.ops, "gather_heads", None)),
            features=torch.stack([self._last_features[r.rid] for r in reqs]) if self._reads_last() else None,
            drafts=drafts,
            greedy=filters.greedy,  # drafts are then the drafter's argmax, no q drawn from
            scores=any(r.grammar is not None for r in reqs),
            filters=filters,
        )

    def _reads_last(self) -> bool:
        return self.drafter is not None and self.drafter.reads_last_features

    def _keep_last(self, req: Request, features: torch.Tensor | None) -> None:
        if self._reads_last():
            self._last_features[req.rid] = features

    def skip_draft(self, reqs: list[Request]) -> Proposal:
        return Proposal(tokens=torch.empty(len(reqs), 0, dtype=torch.long, device=self.device))

    @torch.inference_mode()
    def verify(self, reqs: list[Request], proposal: Proposal) -> Verification:
        """One target forward per request over [last token, drafts]: every row then computes
        with the same shapes alone or in any batch, so outputs are batch-invariant."""
        logits, features = [], []
        for i, req in enumerate(reqs):
            ids = torch.cat([torch.tensor([req.last_token], device=self.device), proposal.tokens[i]])[None]
            positions = req.seq_len - 1 + torch.arange(ids.shape[1], device=self.device)[None]  # [1, K+1]
            hidden, feats = self._target(req, ids, positions)
            logits.append(self.target.logits(hidden[0]))
            features.append(None if feats is None else feats[0])
        stacked = None if features[0] is None else torch.stack(features)  # [N, K+1, n*H]
        return Verification(logits=torch.stack(logits), features=stacked)  # [N, K+1, V]

    def _target(self, req: Request, ids: torch.Tensor, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target over one request's new tokens [1, W], its keys appended to its cache."""
        fwd = Forward(positions, self.kv.attention([req.kv], causal=True, persist=True), self.plan.target_layer_ids)
        return self.target.run(self.kv.ops, fwd, ids)

    @torch.inference_mode()
    def accept(self, reqs: list[Request], proposal: Proposal, verification: Verification) -> Verdict:
        batch = self._batch(reqs)
        # penalties and grammars at each slot as plain decoding applies them there
        logits = masked(adjust_logits(verification.logits, reqs, proposal.tokens), reqs, proposal.tokens)
        probs = probs_from_logits(logits, batch)  # [N, K+1, V]
        first = torch.tensor([r.seq_len for r in reqs], device=self.device)
        verdict = accept_drafts(probs, proposal.tokens, proposal.probs, batch.seed, first, batch.temperature == 0)
        for i, req in enumerate(reqs):
            accepted = int(verdict.num_accepted[i])
            if req.params.logprobs is not None:  # the raw target's, at the positions this round keeps
                logprobs.record(req.logprobs, req.seq_len, verification.logits[i, : accepted + 1],
                                verdict.tokens[i, : accepted + 1], req.params.logprobs)
            # keep KV for the last token and the accepted drafts; the new token is not yet run
            self.kv.truncate(req.kv, req.seq_len + accepted)
            if self.drafter is not None:
                feats = None if verification.features is None else verification.features[i, : accepted + 1]
                self._keep_last(req, None if feats is None else feats[-1])
                self.drafter.extend(req, feats, req.seq_len - 1)
        return verdict

    def free(self, req: Request) -> None:
        if self.prefix is not None:
            self.prefix.release(req.prefix_blocks)
            req.prefix_blocks = []
        req.kv = None
        self._last_features.pop(req.rid, None)
        self._chunks.pop(req.rid, None)  # ended part-way through its prefill
        if self.drafter is not None:
            self.drafter.release(req)
