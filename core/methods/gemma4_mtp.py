"""`gemma4_mtp`: frozen-KV multi-token prediction. A small query-only stack reads the target's
own last-layer KV cache (it writes none) and drafts a chain: each step takes the previous
token's embedding and the previous hidden (the target's last-layer output at the last
verified position for step one, then the drafter's own post-projection), at one fixed query
position for the whole chain."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from draftline.core.contract import DraftRows, KVStore, Proposal

from ..machine import Plan
from ..models.config import ConfigError, ModelConfig, read_config_json
from ..models.gemma4_mtp import PRESETS, Gemma4MTPModel, MTPConfig, load_mtp, mtp_config, preset_config, random_mtp
from ..models.loader import place
from ..models.target import TargetModel
from ..registry import METHODS
from ..request import Request
from ..sampling import Stream, probs_from_logits
from ..spec import DraftModelSpec, SpeculativeSpec
from .base import Drafter, Method


class MTPSpec(SpeculativeSpec):
    method: Literal["gemma4_mtp"] = "gemma4_mtp"
    draft: DraftModelSpec
    num_speculative_tokens: int = Field(3, ge=1, le=32)  # K chained draft steps per round

    def drafter_config(self, read_files: bool) -> MTPConfig | None:
        if self.draft.random_init is not None:
            return preset_config(self.draft.random_init.preset)
        return mtp_config(read_config_json(self.draft.path)) if read_files else None

    def check(self, target: ModelConfig | None, read_files: bool) -> list[str]:
        if self.draft.random_init is not None and self.draft.random_init.preset not in PRESETS:
            known = ", ".join(sorted(PRESETS))
            return [f"speculative.draft.random_init.preset: unknown gemma4_mtp preset "
                    f"{self.draft.random_init.preset!r}; known: {known}"]
        try:
            drafter = self.drafter_config(read_files)
        except ConfigError as exc:
            return [f"speculative.draft.path: {exc}"]
        return [] if drafter is None or target is None else _against_target(drafter, target)


def _against_target(d: MTPConfig, target: ModelConfig) -> list[str]:
    """The drafter's queries read the target's keys: head geometry and widths must agree."""
    out = []
    if d.target_hidden_size != target.hidden_size:
        out.append(f"speculative.draft: target_hidden_size {d.target_hidden_size} != the target's hidden_size "
                   f"{target.hidden_size}; use the drafter made for this target")
    if (d.layers.num_kv_heads, d.layers.head_dim) != (target.num_kv_heads, target.head_dim):
        out.append(f"speculative.draft: the drafter's attention reads the target's KV "
                   f"({target.num_kv_heads} heads of {target.head_dim}) but is shaped for "
                   f"{d.layers.num_kv_heads} heads of {d.layers.head_dim}")
    elif d.layers.num_heads % target.num_kv_heads:
        out.append(f"speculative.draft: {d.layers.num_heads} query heads do not group over the target's "
                   f"{target.num_kv_heads} KV heads")
    if d.layers.vocab_size != target.vocab_size:
        out.append(f"speculative.draft: vocab_size {d.layers.vocab_size} != the target's {target.vocab_size}")
    return out


@METHODS.register("gemma4_mtp")
class MTPMethod(Method):
    config_model = MTPSpec
    cfg: MTPSpec

    def plan(self, target: ModelConfig) -> Plan:
        drafter = self.cfg.drafter_config(read_files=True)
        problems = _against_target(drafter, target)
        if problems:
            raise ConfigError("; ".join(problems))
        src = self.cfg.draft.path or f"random_init {self.cfg.draft.random_init.preset}"
        return Plan(
            method="gemma4_mtp",
            drafting="chain",
            num_speculative_tokens=self.cfg.num_speculative_tokens,
            target_layer_ids=(target.num_layers - 1,),  # the last layer's output: step one's hidden
            drafter_kv="shared",
            draft_sample_method=self.cfg.draft_sample_method,
            drafter=f"{drafter.layers.num_layers} query-only layers, hidden {drafter.layers.hidden_size} "
                    f"(frozen-KV MTP dialect, {src}); options: {drafter.layers.arch} layers"
                    + (" (q norms)" if drafter.layers.qk_norm else ""),
        )

    def build_drafter(self, plan: Plan, target: TargetModel, kv: KVStore, device, dtype) -> Drafter:
        d = self.cfg.draft
        model = load_mtp(d.path) if d.path else random_mtp(d.random_init.preset, d.random_init.seed, device, dtype)
        return MTPDrafter(place(model, device, dtype), target, kv, plan)


class MTPDrafter(Drafter):
    """Reads only ``rows``: the target's KV (shared, read-only) and the target's last-layer
    output at each row's last verified position (``rows.features``, kept by the backend). It
    keeps no state of its own, so its chain is captured as one graph."""

    graph_safe = True
    reads_last_features = True

    def __init__(self, model: Gemma4MTPModel, target: TargetModel, kv: KVStore, plan: Plan):
        self.model, self.target, self.plan, self.ops = model, target, plan, kv.ops
        self.kv_layer = target.config.num_layers - 1
        embedding = target.model.embed_tokens.weight  # [V, H]: the tied readout, as an LM head
        self.readout = nn.Linear(embedding.shape[1], embedding.shape[0], bias=False, device="meta")
        self.readout.weight = embedding

    def extend(self, req: Request, features: Tensor | None, first_position: int) -> None:
        """Nothing to keep: the backend holds the features the next chain starts from."""

    def extend_rows(self, rows: DraftRows, features: Tensor, tokens: Tensor) -> None:
        """Nothing to write: the drafter's queries read the target's own cache."""

    def propose(self, reqs: list[Request], rows: DraftRows) -> Proposal:
        k = rows.verified(self.plan.num_speculative_tokens)  # fewer where the round verifies fewer
        token = rows.last_token[:, None]  # [N, 1]
        hidden = rows.features[:, None]  # [N, 1, H]
        # the chain's one query position (the last token's), over the target's verified keys
        fwd = rows.target_kv.forward(rows.start[:, None], self.kv_layer)
        embedding = self.readout.weight
        tokens, qs, scores, argmax = [], [], [], rows.argmax_drafts(self.plan.draft_sample_method)
        for j in range(k):
            hidden = self.model.run(self.ops, fwd, embedding, token, hidden)
            if argmax and not rows.scores:
                token = self.ops.argmax(self.readout, hidden[:, 0])[:, None]  # [N, 1]
            else:
                logits = self.ops.logits(self.readout, hidden[:, 0])  # [N, V]
                scores.append(logits)
                if argmax:
                    token = logits.argmax(-1)[:, None]
                else:
                    q = probs_from_logits(logits, rows.batch, rows.filters)
                    qs.append(q)
                    token = self.ops.draw(q, rows.batch.seed, rows.start + 1 + j, Stream.DRAFT)[:, None]
            tokens.append(token)
        drafts = torch.cat(tokens, dim=1)  # [N, K]
        return Proposal(tokens=drafts, probs=torch.stack(qs, dim=1) if qs else None,
                        scores=torch.stack(scores, dim=1) if rows.scores else None)


# ---------------------------------------------------------------- training objective


def chain_outputs(model: Gemma4MTPModel, target: TargetModel, tokens: Tensor, steps: int) -> list[Tensor]:
    """Every context end c at once: the chain a round started after verified position c would
    run, fed the true tokens (teacher forcing). Step j at c reads embed(x_{c+1+j}) and the
    previous hidden (the target's last-layer output at c for step 0), queries at position
    c + 1 over the target's last-layer keys 0..c. -> per step, hidden [b, L-1, H] (index c;
    rows with c + 1 + j > L - 1 hold padding)."""
    b, length = tokens.shape
    dev = tokens.device
    last = target.config.num_layers - 1
    kept: dict[str, Tensor] = {}

    def record(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if layer == last:
            kept["k"], kept["v"] = k, v
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    positions = torch.arange(length, device=dev)[None].expand(b, -1)
    with torch.no_grad():
        _, hidden = target(tokens, positions, record, (last,))
    sees = torch.arange(length, device=dev)[None, :] <= torch.arange(length - 1, device=dev)[:, None]  # [L-1, L]

    def read(q: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, kept["k"], kept["v"], attn_mask=sees, enable_gqa=True)

    h, outs = hidden[:, :-1], []
    query = positions[:, 1:]  # c + 1
    for j in range(steps):
        ids = F.pad(tokens[:, 1 + j :], (0, j))  # x_{c+1+j}, zero past the end
        h = model.step(target.embed(ids), h, query, read)
        outs.append(h)
    return outs


def training_loss(model: Gemma4MTPModel, target: TargetModel, tokens: Tensor, steps: int = 4,
                  decay: float = 0.8) -> tuple[Tensor, Tensor, Tensor]:
    """Chained steps over target-generated tokens [b, L]: step j's soft cross-entropy of the
    drafter's q against the target's distribution p for x_{c+2+j}, weighted decay^j (q's KL to
    p up to p's entropy: drafts sampled from q are accepted with probability sum(min(p, q))).
    Returns (loss, correct [steps, b, L-1] argmax agreement, overlap [steps, b, L-1]
    sum(min(p, q)); both 0 where a step runs past the sequence)."""
    length = tokens.shape[1]
    with torch.no_grad():
        positions = torch.arange(length, device=tokens.device)[None].expand(tokens.shape[0], -1)
        hidden, _ = target(tokens, positions, _causal)
        p = F.softmax(target.logits(hidden), dim=-1)  # [b, L, V]: at t, the law of x_{t+1}
    embedding = target.model.embed_tokens.weight
    total, weights, correct, overlap = 0.0, 0.0, [], []
    for j, h in enumerate(chain_outputs(model, target, tokens, steps)):
        valid = torch.arange(length - 1, device=tokens.device) <= length - 2 - j  # c + 1 + j <= L - 1
        want = F.pad(p[:, 1 + j :], (0, 0, 0, j))  # law of x_{c+2+j} at index c
        logp = F.log_softmax(model.logits(h, embedding), dim=-1)
        total = total + decay**j * (-(want * logp).sum(-1))[:, valid].mean()
        weights += decay**j
        correct.append((logp.argmax(-1) == want.argmax(-1)) & valid)
        overlap.append(torch.minimum(want, logp.detach().exp()).sum(-1) * valid)
    return total / weights, torch.stack(correct), torch.stack(overlap)


def _causal(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
