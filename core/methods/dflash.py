"""`dflash`: block-diffusion drafting. One non-causal drafter forward over
[last token, MASK x (B-1)] proposes the whole block; the drafter keeps its own context K/V,
extended each round with only the newly accepted positions' target features."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import structlog
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from draftline.core.contract import DraftRows, KVStore, Proposal

from ..machine import Plan
from ..models.config import ConfigError, DFlashConfig, ModelConfig, dflash_config, read_config_json
from ..models.dflash import DFlashDraftModel
from ..models.layers import causal_attention
from ..models.loader import load_dflash, place, random_dflash
from ..models.presets import DRAFT_PRESETS, dflash_preset
from ..models.target import TargetModel
from ..registry import METHODS
from ..request import Request
from ..sampling import Stream, probs_from_logits
from ..spec import DraftModelSpec, SpeculativeSpec
from .base import Drafter, Method


log = structlog.get_logger("draftline.dflash")


class DFlashSpec(SpeculativeSpec):
    method: Literal["dflash"] = "dflash"
    draft: DraftModelSpec
    block_size: int | None = Field(None, ge=2)  # defaults to the drafter's
    num_speculative_tokens: int | None = Field(None, ge=1)  # K = block_size - 1
    target_layer_ids: list[int] | None = None  # defaults to the drafter's dflash_config
    mask_token_id: int | None = Field(None, ge=0)  # defaults to the drafter's dflash_config

    def drafter_config(self, read_files: bool) -> DFlashConfig | None:
        if self.draft.random_init is not None:
            return dflash_preset(self.draft.random_init.preset)
        return dflash_config(read_config_json(self.draft.path)) if read_files else None

    def check(self, target: ModelConfig | None, read_files: bool) -> list[str]:
        if self.draft.random_init is not None and self.draft.random_init.preset not in DRAFT_PRESETS:
            known = ", ".join(sorted(DRAFT_PRESETS))
            return [f"speculative.draft.random_init.preset: unknown preset {self.draft.random_init.preset!r}; known: {known}"]
        try:
            drafter = self.drafter_config(read_files)
        except ConfigError as exc:
            return [f"speculative.draft.path: {exc}"]
        return _problems(self, target, drafter)


@dataclass(frozen=True)
class Resolved:
    block_size: int
    layer_ids: tuple[int, ...]
    mask_token_id: int


def resolve(cfg: DFlashSpec, drafter: DFlashConfig) -> Resolved:
    block = cfg.block_size or (cfg.num_speculative_tokens + 1 if cfg.num_speculative_tokens else drafter.block_size)
    ids = tuple(cfg.target_layer_ids) if cfg.target_layer_ids is not None else drafter.target_layer_ids
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else drafter.mask_token_id
    return Resolved(block_size=block, layer_ids=ids, mask_token_id=-1 if mask is None else mask)


def _problems(cfg: DFlashSpec, target: ModelConfig | None, drafter: DFlashConfig | None) -> list[str]:
    out = []
    if cfg.block_size and cfg.num_speculative_tokens and cfg.num_speculative_tokens != cfg.block_size - 1:
        out.append(
            f"speculative.num_speculative_tokens: {cfg.num_speculative_tokens} disagrees with block_size "
            f"{cfg.block_size} (DFlash drafts block_size - 1 tokens); give one of the two"
        )
    if drafter is None:  # a drafter folder unread: what the spec itself gives can still meet a known target
        given = Resolved(cfg.block_size or 0, tuple(cfg.target_layer_ids or ()),
                         -1 if cfg.mask_token_id is None else cfg.mask_token_id)
        return out + (_ids_against_target(given, target) if target is not None else [])
    r = resolve(cfg, drafter)
    if r.block_size > drafter.block_size:
        out.append(f"speculative.block_size: {r.block_size} exceeds the drafter's block_size {drafter.block_size}; use at most {drafter.block_size}")
    if len(r.layer_ids) != len(drafter.target_layer_ids):
        out.append(
            f"speculative.target_layer_ids: {len(r.layer_ids)} ids given, the drafter's fc takes "
            f"{len(drafter.target_layer_ids)} layers' features; give {len(drafter.target_layer_ids)} ids"
        )
    if r.mask_token_id < 0:
        out.append("speculative.mask_token_id: the drafter's config has none; set mask_token_id to the tokenizer's mask id")
    if target is not None:
        out += _against_target(r, drafter, target)
    return out


def _ids_against_target(r: Resolved, target: ModelConfig) -> list[str]:
    out = []
    bad = [i for i in r.layer_ids if not -1 <= i < target.num_layers]
    if bad:
        out.append(f"speculative.target_layer_ids: {bad} outside the target's layers 0..{target.num_layers - 1} "
                   "(ids name layers whose output is tapped; -1: the embedding output)")
    if r.mask_token_id >= target.vocab_size:
        out.append(f"speculative.mask_token_id: {r.mask_token_id} is outside the target vocabulary ({target.vocab_size})")
    return out


def _against_target(r: Resolved, drafter: DFlashConfig, target: ModelConfig) -> list[str]:
    out = _ids_against_target(r, target)
    if drafter.layers.hidden_size != target.hidden_size:
        out.append(
            f"speculative.draft: drafter hidden_size {drafter.layers.hidden_size} != target hidden_size "
            f"{target.hidden_size}; the drafter must be trained for this target"
        )
    if drafter.num_target_layers is not None and drafter.num_target_layers != target.num_layers:
        out.append(
            f"speculative.draft: drafter was trained for a {drafter.num_target_layers}-layer target, "
            f"this target has {target.num_layers}; use the drafter made for this target"
        )
    return out


@METHODS.register("dflash")
class DFlashMethod(Method):
    config_model = DFlashSpec
    cfg: DFlashSpec

    def plan(self, target: ModelConfig) -> Plan:
        drafter = self.cfg.drafter_config(read_files=True)
        problems = _problems(self.cfg, target, drafter)
        if problems:
            raise ConfigError("; ".join(problems))
        r = resolve(self.cfg, drafter)
        if r.block_size < drafter.block_size:
            log.warning("dflash.block_smaller_than_trained", block_size=r.block_size, trained=drafter.block_size,
                        note="the block attends non-causally over its MASK slots; fewer slots than trained "
                             "shifts every slot's input (tiny-dflash at block 8: tau 1.12 against 2.97 at 16)")
        src = self.cfg.draft.path or f"random_init {self.cfg.draft.random_init.preset}"
        return Plan(
            method="dflash",
            drafting="parallel",
            num_speculative_tokens=r.block_size - 1,
            target_layer_ids=r.layer_ids,
            drafter_kv="own",
            draft_sample_method=self.cfg.draft_sample_method,
            block_size=r.block_size,
            drafter=f"{drafter.layers.num_layers} layers, hidden {drafter.layers.hidden_size} ({drafter.dialect} "
                    f"dialect, {src}); options: trained block size {drafter.block_size}, mask token "
                    f"{drafter.mask_token_id}, tapped layer outputs {list(drafter.target_layer_ids)}"
                    + ("" if drafter.num_target_layers is None else f" of {drafter.num_target_layers}")
                    + (" (-1: the embedding output)" if -1 in drafter.target_layer_ids else "")
                    + "".join(f", layer {i}: sliding window {w}" for i, w in drafter.windows().items())
                    + ("" if not drafter.windows() else ", each sliding query over the window ending at itself"
                       if drafter.sliding_per_query else ", sliding blocks causal" if drafter.sliding_block_causal
                       else ", sliding blocks non-causal")
                    + ("" if drafter.draft_vocab_size is None else
                       f", its own lm_head over a draft vocabulary of {drafter.draft_vocab_size}"),
        )

    def build_drafter(self, plan: Plan, target: TargetModel, kv: KVStore, device, dtype) -> Drafter:
        d = self.cfg.draft
        model = load_dflash(d.path) if d.path else random_dflash(d.random_init.preset, d.random_init.seed, device, dtype)
        mask = resolve(self.cfg, model.config).mask_token_id
        return DFlashDrafter(place(model, device, dtype), target, kv, plan, mask)


class DFlashDrafter(Drafter):
    graph_safe = True

    def __init__(self, model: DFlashDraftModel, target: TargetModel, kv: KVStore, plan: Plan, mask_token_id: int):
        self.model, self.target, self.kv, self.plan = model, target, kv, plan
        self.mask_token_id = mask_token_id
        cfg = model.config
        # sliding layers: the last `window` context positions before the block (speculators), or
        # each query's window ending at itself (z-lab), as both backends' stores apply them
        self.windowed = {"windows": cfg.windows(), "block_causal": cfg.sliding_block_causal,
                         "per_query": cfg.sliding_per_query} if cfg.windows() else {}
        # id of a request's cache -> [first position, end, features [n, taps*H] in order]: context
        # not yet stored, so rounds decoded plainly cost no drafter work, and a run of them is
        # stored in one forward once the request drafts again
        self.pending: dict[int, list] = {}

    def admit(self, req: Request) -> None:
        req.draft_state = self.kv.new(len(self.model.layers))

    def extend(self, req: Request, features: Tensor | None, first_position: int) -> None:
        if req.draft_state is None:
            self.admit(req)
        run = self.pending.get(id(req.draft_state))
        if run is not None and run[1] != first_position:  # not where the run ends: store it first
            self.store_pending(req)
            run = None
        if run is None:
            run = self.pending[id(req.draft_state)] = [first_position, first_position, []]
        run[1] += features.shape[0]
        run[2].append(features)

    def store_pending(self, req: Request) -> None:
        """The request's pending context into its cache, in one forward."""
        run = self.pending.pop(id(req.draft_state), None)
        if run is None:
            return
        start, _, parts = run
        features = torch.cat(parts) if len(parts) > 1 else parts[0]  # [n, taps*H]
        positions = torch.arange(start, start + features.shape[0], device=features.device)[None]
        fwd = self.kv.forward([req.draft_state], positions, causal=False)
        self.model.store_context(self.kv.ops, fwd, features[None])

    def release(self, req: Request) -> None:
        self.pending.pop(id(req.draft_state), None)
        super().release(req)

    def extend_rows(self, rows: DraftRows, features: Tensor, tokens: Tensor) -> None:
        positions = rows.positions  # [N, W]
        if positions is None:
            positions = rows.start[:, None] + torch.arange(features.shape[1], device=features.device)
        fwd = self.kv.forward(rows.caches, positions, causal=False, end=rows.end)
        self.model.store_context(self.kv.ops, fwd, features)

    def propose(self, reqs: list[Request], rows: DraftRows) -> Proposal:
        for req in reqs:  # what their plain rounds left to store
            self.store_pending(req)
        n, ops = rows.last_token.shape[0], self.kv.ops
        # [N, B] each: ids anchor, MASK, ...; positions start .. start + B - 1
        ids, positions = ops.block_window(rows.last_token, rows.start, self.mask_token_id, self.plan.block_size)
        fwd = self.kv.forward(rows.caches, positions, causal=False, persist=False, **self.windowed)
        hidden = self.model.run(ops, fwd, ops.embed(self.target.model.embed_tokens.weight, ids))
        # the block attends as a whole, but only the slots the round verifies are read out
        read = 1 + rows.verified(self.plan.block_size - 1)
        argmax = rows.argmax_drafts(self.plan.draft_sample_method)
        if argmax and not rows.scores:  # slot k predicts position start + k
            best = ops.argmax(self.model.head(self.target), hidden[:, 1:read])  # [N, K] drafter-vocabulary ids
            return Proposal(tokens=self.model.to_target_ids(best))
        logits = self.model.logits(hidden[:, 1:read], self.target, ops)  # [N, K, V]
        scores = logits if rows.scores else None
        if argmax:
            return Proposal(tokens=logits.argmax(-1), scores=scores)
        q = probs_from_logits(logits, rows.batch, rows.filters)  # [N, K, V]
        k, v = q.shape[1], q.shape[2]
        seeds = rows.batch.seed.to(q.device)[:, None].expand(n, k).reshape(-1)
        tokens = ops.draw(q.reshape(-1, v), seeds, positions[:, 1:read].reshape(-1), Stream.DRAFT)
        return Proposal(tokens=tokens.view(n, k), probs=q, scores=scores)


# ---------------------------------------------------------------- training objective


@dataclass(frozen=True)
class BlockBatch:
    """Anchored blocks cut from target-generated sequences."""

    tokens: Tensor  # [b, L] token ids
    anchors: Tensor  # [b, A] positions of each block's first slot (the anchor token)


def training_loss(
    drafter: DFlashDraftModel, target: TargetModel, batch: BlockBatch, mask_token_id: int, gamma: float = 7.0,
    soft: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Weighted loss on slots 1..B-1, each block seeing target features strictly before its
    anchor: (1 - soft) x cross-entropy of the token there, plus soft x cross-entropy to the
    target's whole distribution p there (its KL to the drafter's q, up to p's entropy). The
    token alone teaches the argmax, which greedy verification accepts; sampled verification
    accepts a draft drawn from q with probability sum(min(p, q)), which needs q close to p.
    Returns (loss, correct [b, A, B-1] bool argmax agreement, overlap [b, A, B-1] sum(min(p, q)))."""
    if drafter.config.windows() or drafter.config.draft_vocab_size is not None:
        raise ValueError("training a DFlash drafter with sliding-window layers or a reduced vocabulary is not "
                         "supported (the block mask here has no window; the loss reads the target's vocabulary)")
    tokens, anchors = batch.tokens, batch.anchors
    b, length = tokens.shape
    a, blk = anchors.shape[1], drafter.config.block_size
    dev = tokens.device
    positions = torch.arange(length, device=dev)[None].expand(b, -1)
    block_pos = anchors[..., None] + torch.arange(blk, device=dev)  # [b, A, B]
    with torch.no_grad():
        final, features = target(tokens, positions, causal_attention, drafter.config.target_layer_ids)
        before = (block_pos[..., 1:] - 1).flatten(1)  # [b, A*(B-1)]: the position whose output predicts slot k
        seen = final.gather(1, before[..., None].expand(-1, -1, final.shape[-1]))
        p = F.softmax(target.logits(seen), dim=-1).view(b, a, blk - 1, -1)  # [b, A, B-1, V]
    context = drafter.context_kv(features, positions)  # per layer (k, v) [b, Hkv, L, D]
    labels = tokens.gather(1, block_pos.flatten(1)).view(b, a, blk)
    ids = torch.full_like(labels, mask_token_id)
    ids[..., 0] = labels[..., 0]
    sees = _block_mask(anchors, length, blk)  # [b, 1, A*B, L + A*B]

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        keys = torch.cat([context[layer][0], k], dim=2)
        values = torch.cat([context[layer][1], v], dim=2)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=sees, enable_gqa=True)

    hidden = drafter(target.embed(ids.flatten(1)), block_pos.flatten(1), attend)  # [b, A*B, H]
    logits = target.logits(hidden.view(b, a, blk, -1)[:, :, 1:])  # [b, A, B-1, V]
    logq = F.log_softmax(logits, dim=-1)
    hard = -logq.gather(-1, labels[:, :, 1:, None])[..., 0]  # [b, A, B-1]
    per_slot = hard if soft == 0 else (1 - soft) * hard - soft * (p * logq).sum(-1)
    weight = torch.exp(-torch.arange(blk - 1, device=dev, dtype=torch.float32) / gamma)  # exp(-(k-1)/gamma)
    loss = (per_slot * weight).sum(-1).mean() / weight.sum()
    overlap = torch.minimum(p, logq.detach().exp()).sum(-1)
    return loss, logits.argmax(-1) == labels[:, :, 1:], overlap


def _block_mask(anchors: Tensor, length: int, blk: int) -> Tensor:
    """Slot (a, k) sees context positions < anchor_a and every slot of its own block a."""
    b, a = anchors.shape
    dev = anchors.device
    ctx = torch.arange(length, device=dev)[None, None] < anchors[..., None]  # [b, A, L]
    ctx = ctx[:, :, None].expand(b, a, blk, length).reshape(b, a * blk, length)
    which = torch.arange(a * blk, device=dev) // blk
    own = (which[:, None] == which[None, :]).expand(b, -1, -1)  # [b, A*B, A*B]
    return torch.cat([ctx, own], dim=-1)[:, None]


def expected_accept_length(correct: Tensor) -> float:
    """τ if every block were verified greedily (``correct`` [..., B-1] bool: 1 + the mean
    leading correct run), or with drafts sampled from q (``correct`` the overlaps sum(min(p, q)):
    1 + the mean of each slot's chance that it and every slot before it are accepted)."""
    return 1.0 + float(correct.float().cumprod(dim=-1).sum(-1).mean())
