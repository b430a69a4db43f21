"""`eagle3`: chain drafting with a head fed with fused target features (one decoder layer, or
several in the speculators format, sliding-window layers among them).

Round by round: the target's features of the newly verified positions wait in the request's
state until the next draft. Drafting then runs the head over those positions (each position t
reads embed(x_{t+1}) and fc(features_t), and its K/V joins the head's own cache for good);
the output at the last one gives draft 1, and each further step feeds the head's output back
with the embedding of the draft it just made, one position on. Those chained positions' K/V
are dropped at the next draft, which starts where the verified context ends.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from draftline.core.contract import DraftRows, KVStore, Proposal

from ..machine import Plan
from ..models.checkpoint import tensor_files
from ..models.config import ConfigError, ModelConfig, read_config_json
from ..models.eagle3 import PRESETS, Eagle3Config, Eagle3DraftModel, default_aux_layer_ids, eagle3_config, \
    keep_own_embedding, load_eagle3, preset_config, random_eagle3
from ..models.layers import causal_attention
from ..models.loader import place
from ..models.target import TargetModel
from ..registry import METHODS
from ..request import Request
from ..sampling import SamplingBatch, Stream, probs_from_logits
from ..spec import DraftModelSpec, SpeculativeSpec
from .base import Drafter, Method


class Eagle3Spec(SpeculativeSpec):
    method: Literal["eagle3"] = "eagle3"
    draft: DraftModelSpec
    num_speculative_tokens: int = Field(3, ge=1, le=32)  # K chained draft steps per round
    # target layers whose *input* hidden states are tapped; defaults to the checkpoint's, else (2, N/2, N-3)
    target_layer_ids: list[int] | None = None

    def drafter_config(self, read_files: bool) -> Eagle3Config | None:
        if self.draft.random_init is not None:
            return preset_config(self.draft.random_init.preset)
        return eagle3_config(read_config_json(self.draft.path)) if read_files else None

    def check(self, target: ModelConfig | None, read_files: bool) -> list[str]:
        if self.draft.random_init is not None and self.draft.random_init.preset not in PRESETS:
            known = ", ".join(sorted(PRESETS))
            return [f"speculative.draft.random_init.preset: unknown eagle3 preset {self.draft.random_init.preset!r}; "
                    f"known: {known}"]
        try:
            drafter = self.drafter_config(read_files)
        except ConfigError as exc:
            return [f"speculative.draft.path: {exc}"]
        return _problems(self, target, drafter)


def aux_layer_ids(cfg: Eagle3Spec, drafter: Eagle3Config, num_target_layers: int) -> tuple[int, ...]:
    if cfg.target_layer_ids is not None:
        return tuple(cfg.target_layer_ids)
    return drafter.aux_layer_ids or default_aux_layer_ids(num_target_layers)


def _problems(cfg: Eagle3Spec, target: ModelConfig | None, drafter: Eagle3Config | None) -> list[str]:
    out = []
    if drafter is None:  # a drafter folder unread: the spec's own ids can still meet a known target
        return _ids_against_target(tuple(cfg.target_layer_ids or ()), target) if target is not None else []
    if drafter.layer.vocab_size < drafter.draft_vocab_size:
        out.append(f"speculative.draft: draft_vocab_size {drafter.draft_vocab_size} exceeds vocab_size "
                   f"{drafter.layer.vocab_size}; d2t maps draft ids into the target vocabulary, so it cannot be larger")
    if cfg.target_layer_ids is not None and len(cfg.target_layer_ids) != drafter.num_aux:
        out.append(f"speculative.target_layer_ids: {len(cfg.target_layer_ids)} ids given, the drafter's fc takes "
                   f"{drafter.num_aux} layers' features; give {drafter.num_aux} ids")
    if target is None:
        return out
    out += _ids_against_target(aux_layer_ids(cfg, drafter, target.num_layers), target)
    if drafter.target_hidden_size != target.hidden_size:
        out.append(f"speculative.draft: the drafter's fc expects features of width {drafter.target_hidden_size}, "
                   f"this target's hidden_size is {target.hidden_size}; use the drafter made for this target")
    if drafter.layer.vocab_size != target.vocab_size:
        out.append(f"speculative.draft: drafter vocab_size {drafter.layer.vocab_size} != target vocab_size "
                   f"{target.vocab_size}; d2t/t2d must map onto this target's vocabulary")
    if drafter.layer.hidden_size != target.hidden_size:
        out.append(f"speculative.draft: drafter hidden_size {drafter.layer.hidden_size} != target hidden_size "
                   f"{target.hidden_size}; the head reads the target's embeddings")
    return out


def _ids_against_target(ids: tuple[int, ...], target: ModelConfig) -> list[str]:
    bad = [i for i in ids if not 0 <= i <= target.num_layers]
    if not bad:
        return []
    return [f"speculative.target_layer_ids: {bad} outside 0..{target.num_layers} (each id names a target "
            f"layer whose input is tapped; 0: the embedding output, {target.num_layers}: the last layer's "
            "output before the final norm)"]


@METHODS.register("eagle3")
class Eagle3Method(Method):
    config_model = Eagle3Spec
    cfg: Eagle3Spec

    def plan(self, target: ModelConfig) -> Plan:
        drafter = self.cfg.drafter_config(read_files=True)
        problems = _problems(self.cfg, target, drafter)
        if problems:
            raise ConfigError("; ".join(problems))
        ids = aux_layer_ids(self.cfg, drafter, target.num_layers)
        src = self.cfg.draft.path or f"random_init {self.cfg.draft.random_init.preset}"
        options = drafter.options()
        if self.cfg.draft.path and "embed_tokens.weight" in tensor_files(self.cfg.draft.path):
            options.append("its own embed_tokens where it differs from the target's")
        return Plan(
            method="eagle3",
            drafting="chain",
            num_speculative_tokens=self.cfg.num_speculative_tokens,
            target_layer_ids=tuple(i - 1 for i in ids),  # the input of layer i is the output of layer i-1
            drafter_kv="own",
            draft_sample_method=self.cfg.draft_sample_method,
            drafter=f"{drafter.layer.num_layers} layer{'s' if drafter.layer.num_layers > 1 else ''}, "
                    f"hidden {drafter.layer.hidden_size}, draft vocab {drafter.draft_vocab_size} "
                    f"({drafter.dialect_name} dialect, {src}); options: {', '.join(options)}; taps the inputs of "
                    f"layers {list(ids)} in EAGLE-3's numbering (layer i's input is layer i-1's output)",
        )

    def build_drafter(self, plan: Plan, target: TargetModel, kv: KVStore, device, dtype) -> Drafter:
        d = self.cfg.draft
        model = load_eagle3(d.path) if d.path else random_eagle3(d.random_init.preset, d.random_init.seed, device, dtype)
        model = place(model, device, dtype)
        keep_own_embedding(model, target)  # a frozen copy of the target's is dropped
        return Eagle3Drafter(model, target, kv, plan)


@dataclass
class Eagle3State:
    """With an append-only store: a request's head cache, and the verified positions' features
    not yet run through it."""

    cache: Any  # the lent store's handle, one layer
    start: int  # position of the first pending feature row (= the cache's verified length)
    pending: Tensor | None = None  # [m, taps*H]


class Eagle3Drafter(Drafter):
    """Two forms, chosen by the lent store. With an append-only store (the reference backend)
    each request's verified features wait until its next draft, when their next tokens are
    known. With a store indexed by absolute position (the cuda backend) the head's entries are
    written where they belong: the verify step writes every window position whose next token
    it holds (the last token and the drafts), and the draft step the last verified position,
    whose next token is the round's last token; that draft step and its chain read only
    ``rows``, so they are captured as one graph."""

    graph_safe = True
    reads_last_features = True
    extends_from_features = True  # extend_rows: the entry at start - 1 takes rows.features

    def __init__(self, model: Eagle3DraftModel, target: TargetModel, kv: KVStore, plan: Plan):
        self.model, self.target, self.kv, self.plan = model, target, kv, plan
        self.ops, self.table = kv.ops, model.table(target)
        cfg = model.config
        self.num_layers = cfg.layer.num_layers
        self.windows = cfg.windows() or None  # layer -> sliding window; a chain keeps the window it starts with
        self.ascending = model.ascending_ids()  # greedy chains may read the draft vocabulary's argmax
        self.same_ids = not bool(model.d2t.any())  # draft id = target id: no map to apply in the chain

    def extend(self, req: Request, features: Tensor | None, first_position: int) -> None:
        if self.kv.positional:
            raise RuntimeError("an EAGLE-3 head on a positional store takes its entries through prefill_rows and "
                               "extend_rows")
        st = req.draft_state
        if st is None:
            st = req.draft_state = Eagle3State(cache=self.kv.new(self.num_layers), start=first_position)
        if st.pending is None:
            st.start, st.pending = first_position, features
        else:
            st.pending = torch.cat([st.pending, features])

    def admit(self, req: Request) -> None:
        req.draft_state = self.kv.new(self.num_layers)

    def prefill_rows(self, rows: DraftRows, features: Tensor, ids: Tensor) -> None:
        """Entries for prompt positions 0 .. P - 2 in one causal pass (position t reads token
        t + 1 and the features at t)."""
        n, p = ids.shape
        positions = torch.arange(p - 1, device=ids.device).repeat(n, 1)  # [N, P - 1]
        fwd = self.kv.prefill(rows.caches, positions, self.windows)
        self.model.run(self.ops, fwd, self.table, ids[:, 1:], self.model.fuse(features[:, :-1], self.ops, fwd))

    def extend_rows(self, rows: DraftRows, features: Tensor, tokens: Tensor) -> None:
        """Entries for positions start - 1 .. start + W - 2: position t reads the window's token
        at t + 1 and the features at t (start - 1's from rows.features). Past a row's accepted
        run they are wrong and are never read: the next round writes over them."""
        first = (rows.start - 1).clamp(min=0)  # padding rows sit at 0
        feats = torch.cat([rows.features[:, None], features[:, :-1]], dim=1)  # [N, W, taps*H]
        positions = first[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
        fwd = self.kv.forward(rows.caches, positions, causal=True, windows=self.windows)
        self.model.run(self.ops, fwd, self.table, tokens, self.model.fuse(feats, self.ops, fwd))

    def propose(self, reqs: list[Request], rows: DraftRows) -> Proposal:
        # rows None: the reference's requests, one at a time
        argmax = self.plan.draft_sample_method == "greedy" if rows is None else rows.argmax_drafts(
            self.plan.draft_sample_method)
        scores = rows is not None and rows.scores  # the logits kept: a grammar chooses drafts again
        # the chain's steps: K, fewer where the round verifies fewer drafts
        k = self.plan.num_speculative_tokens if rows is None else rows.verified(self.plan.num_speculative_tokens)
        if self.kv.positional and self.ascending and argmax and not scores:
            return Proposal(tokens=self._greedy_rows(rows, k))
        if self.kv.positional:
            logits = self._chain_rows(rows, k)  # [N, k, V]
        else:  # one request at a time (its pending context, then k - 1 chained steps)
            logits = torch.stack([self._chain(req, k) for req in reqs])
        proposal = Proposal(tokens=logits.argmax(-1)) if argmax else self._sampled(logits, rows)
        return replace(proposal, scores=logits) if scores else proposal

    def _chain_rows(self, rows: DraftRows, k: int) -> Tensor:
        """Positional store: the last verified position's entry (the round's last token and
        rows.features), then k - 1 chained steps, one position on each -> logits [N, k, V]."""
        steps = []
        token, out, normed = None, None, None
        for j, fwd in enumerate(self._chain_forwards(rows, k)):
            if j == 0:
                token, hidden = rows.last_token, self.model.fuse(rows.features[:, None], self.ops, fwd)
            else:
                token, hidden = self._pick_rows(steps[-1], rows, j - 1), self.model.next_hidden(out, normed)
            out, normed = self.model.run(self.ops, fwd, self.table, token[:, None], hidden)  # [N, 1, H] each
            steps.append(self.model.logits(out[:, 0], normed[:, 0], self.ops))  # [N, V]
        return torch.stack(steps, dim=1)

    def _greedy_rows(self, rows: DraftRows, k: int) -> Tensor:
        """_chain_rows for greedy drafts, reading out tokens (no logits) -> [N, k]."""
        tokens = []
        out, normed = None, None
        for j, fwd in enumerate(self._chain_forwards(rows, k)):
            if j == 0:
                token, hidden = rows.last_token, self.model.fuse(rows.features[:, None], self.ops, fwd)
            else:
                token, hidden = tokens[-1], self.model.next_hidden(out, normed)
            out, normed = self.model.run(self.ops, fwd, self.table, token[:, None], hidden)
            tokens.append(self._greedy(self.model.readout(out, normed)[:, 0]))  # [N]
        return torch.stack(tokens, dim=1)

    def _chain_forwards(self, rows: DraftRows, k: int):
        """The k forwards of a chain over a positional store: the first at the last verified
        position (start - 1), step j + 1 one position on, each writing its key there, every
        sliding window anchored where the chain starts (as the reference's)."""
        first = (rows.start - 1).clamp(min=0)  # [N]
        later = _later_positions(first, k)  # [K, N]: step j + 1's position, step j's key count
        for j in range(k):
            at = first if j == 0 else later[j - 1]
            yield self.kv.forward(rows.caches, at[:, None], causal=True, windows=self.windows, anchor=first,
                                  end=later[j])

    def _greedy(self, readout: Tensor) -> Tensor:
        """The greedy target id from what lm_head reads [N, H]; a draft vocabulary that is the
        target's skips the id map (two launches a chain step)."""
        if self.same_ids:
            return self.ops.argmax(self.model.lm_head, readout)
        return self.model.greedy(self.ops, readout)

    def _pick_rows(self, logits: Tensor, rows: DraftRows, j: int) -> Tensor:
        """Draft j + 1's token, as propose() will choose it: argmax, or the seeded draw."""
        if rows.argmax_drafts(self.plan.draft_sample_method):
            return logits.argmax(-1)
        q = probs_from_logits(logits, rows.batch, rows.filters)
        return self.ops.draw(q, rows.batch.seed, rows.start + 1 + j, Stream.DRAFT)

    def _chain(self, req: Request, k: int) -> Tensor:
        """-> float32 logits [k, V] of k draft steps (each step's token is its argmax, or a
        draw keyed by (seed, position) when drafting probabilistically)."""
        st = req.draft_state
        self.kv.truncate(st.cache, st.start)  # drop last round's chained positions
        m = st.pending.shape[0]
        ids = torch.tensor([req.token_ids[st.start + 1 : st.start + 1 + m]], device=st.pending.device)  # [1, m]
        positions = st.start + torch.arange(m, device=ids.device)[None]  # [1, m]
        # a sliding window stays anchored at the chain's start for its later steps, as speculators trains it
        fwd = self.kv.forward([st.cache], positions, causal=True, windows=self.windows, anchor=st.start + m - 1)
        out, normed = self.model.run(self.ops, fwd, self.table, ids, self.model.fuse(st.pending[None], self.ops, fwd))
        out, normed = out[:, -1:], normed[:, -1:]
        st.start, st.pending = st.start + m, None
        steps = []
        for j in range(k):
            logits = self.model.logits(out[0, -1], normed[0, -1], self.ops)  # [V]
            steps.append(logits)
            if j == k - 1:
                break
            token = self._pick(logits, req, st.start + j)
            at = fwd.with_positions(torch.tensor([[st.start + j]], device=ids.device))  # the token's own position - 1
            out, normed = self.model.run(self.ops, at, self.table, token.view(1, 1), self.model.next_hidden(out, normed))
        return torch.stack(steps)

    def _pick(self, logits: Tensor, req: Request, position: int) -> Tensor:
        """The token a chain step feeds forward: as propose() will choose it."""
        if self.plan.draft_sample_method == "greedy" or req.params.greedy:  # a greedy row's q is one-hot
            return logits.argmax()
        batch = SamplingBatch.of([req.params], logits.device)
        q = probs_from_logits(logits[None], batch)
        return self.ops.draw(q, batch.seed, torch.tensor([position + 1], device=logits.device), Stream.DRAFT)[0]

    def _sampled(self, logits: Tensor, rows: DraftRows) -> Proposal:
        n, k, v = logits.shape
        b = rows.batch  # a backend may pass a padded bucket of rows: keep the first n
        batch = SamplingBatch(temperature=b.temperature[:n], top_k=b.top_k[:n], top_p=b.top_p[:n], seed=b.seed[:n])
        q = probs_from_logits(logits, batch, rows.filters)  # [N, K, V]
        seeds = batch.seed.to(q.device)[:, None].expand(n, k).reshape(-1)
        positions = rows.start[:n, None] + 1 + torch.arange(k, device=q.device)  # each draft's position
        tokens = self.ops.draw(q.reshape(-1, v), seeds, positions.reshape(-1), Stream.DRAFT)
        return Proposal(tokens=tokens.view(n, k), probs=q)


def _later_positions(first: Tensor, k: int) -> Tensor:
    """A chain's later positions [K, N], first + 1 + j in row j (contiguous rows): step j + 1's
    position and step j's end (its keys' count), made in one go, not a launch or two a step
    inside the draft graph."""
    return first[None] + torch.arange(1, max(k, 1) + 1, device=first.device)[:, None]


# ---------------------------------------------------------------- training objective


def chain_outputs(model: Eagle3DraftModel, embeds: Tensor, hidden: Tensor, steps: int) -> list[Tensor]:
    """Training-time test: the head's outputs for ``steps`` chained steps over whole sequences
    at once. embeds [b, L, H] are embed(x_{t+1}) at positions t, hidden [b, L, H] is fc of the
    target features. Step j at position t stands where inference stands j steps into a chain
    started at t - j: its hidden is step j-1's output at t-1, and it sees step 0's keys up to
    t - j and step i's key at t - j + i (i = 1..j). Rows t < j have no such chain (masked out
    of the loss by the caller). -> per step, outputs [b, L, H]."""
    b, length, _ = embeds.shape
    dev = embeds.device
    windows = model.config.windows()
    positions = torch.arange(length, device=dev)[None].expand(b, -1)
    keys: dict[int, list[tuple[Tensor, Tensor]]] = {}  # layer -> each step's keys and values
    outs = []
    t = torch.arange(length, device=dev)
    for j in range(steps):
        if j:
            fed = model.next_hidden(outs[-1])  # step j-1's output (or its norm: norm_output)
            hidden = torch.cat([hidden[:, :1], fed[:, :-1]], dim=1)  # shift: step j-1's output at t-1

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor, j=j) -> Tensor:
            keys.setdefault(layer, []).append((k, v))
            ks = torch.cat([kk for kk, _ in keys[layer]], dim=2)  # [b, Hkv, (j+1)*L, D]
            vs = torch.cat([vv for _, vv in keys[layer]], dim=2)
            window = windows.get(layer)
            s = t[None, :]  # key position within each step's block
            blocks = [s <= t[:, None] - j] + [s == t[:, None] - j + i for i in range(1, j + 1)]
            mask = torch.cat(blocks, dim=1)  # [L, (j+1)*L]
            if window is not None:  # the chain started at t - j sees step 0's keys back to t - j - window + 1
                mask[:, :length] &= s > t[:, None] - j - window
            mask = mask | ~mask.any(dim=1, keepdim=True)  # rows t < j see nothing: give them all (ignored)
            return F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask, enable_gqa=True)

        outs.append(model.step(embeds, hidden, positions, attend))
    return outs


def training_loss(model: Eagle3DraftModel, target: TargetModel, tokens: Tensor, steps: int = 7,
                  decay: float = 0.8) -> tuple[Tensor, Tensor, Tensor]:
    """Unrolled training-time test over target-generated tokens [b, L]: at every step j, soft
    cross-entropy of the head's draft-vocabulary distribution q against the target's own p
    (restricted to the draft vocabulary, renormalized) for the token two places on, weighted
    decay^j: q's KL to p up to p's entropy, so drafts sampled from q are accepted with
    probability sum(min(p, q)). Returns (loss, correct [steps, b, L-1] bool: argmax agreement,
    overlap [steps, b, L-1]: sum(min(p, q)); both 0 where a step is undefined)."""
    b, length = tokens.shape
    dev = tokens.device
    ids = model.draft_ids()
    taps = tuple(i - 1 for i in (model.config.aux_layer_ids or default_aux_layer_ids(target.config.num_layers)))
    positions = torch.arange(length, device=dev)[None].expand(b, -1)
    with torch.no_grad():
        hidden, features = target(tokens, positions, causal_attention, taps)
        p = F.softmax(target.logits(hidden)[..., ids], dim=-1)  # [b, L, Vd]: target at t predicts x_{t+1}
    embeds = model.embed(target, tokens[:, 1:])  # position t reads x_{t+1}, t = 0 .. L-2
    outs = chain_outputs(model, embeds, model.fuse(features[:, :-1]), steps)
    want = p[:, 1:]  # position t's head output predicts x_{t+2}: the target's distribution at t+1
    total, weights, correct, overlap = 0.0, 0.0, [], []
    for j, out in enumerate(outs):
        logp = F.log_softmax(model.lm_head(model.readout(out)).float(), dim=-1)  # [b, L-1, Vd]
        valid = torch.arange(length - 1, device=dev) >= j  # a chain of j steps needs t >= j
        ce = -(want * logp).sum(-1)[:, valid]
        total = total + decay**j * ce.mean()
        weights += decay**j
        correct.append((logp.argmax(-1) == want.argmax(-1)) & valid)
        overlap.append(torch.minimum(want, logp.detach().exp()).sum(-1) * valid)
    return total / weights, torch.stack(correct), torch.stack(overlap)
