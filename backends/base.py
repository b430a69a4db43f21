"""The protocols between the machine, the backends and the methods' drafters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from core.models.layers import AttentionFn
from core.request import Request
from core.sampling import SamplingBatch, Verdict


@dataclass(frozen=True)
class Capacity:
    """What a backend sizes its persistent state by."""

    max_batch: int  # requests running at once (server.max_batch_size)
    max_model_len: int  # prompt + output tokens of one request
    graphs: bool = True  # capture CUDA graphs where the backend can


@dataclass(frozen=True)
class Proposal:
    """A round's drafts for every running request."""

    tokens: Tensor  # [N, K] int64
    probs: Tensor | None = None  # [N, K, V] the drafter's q, or None for argmax drafts

    def rows(self, keep: list[int]) -> "Proposal":
        return Proposal(self.tokens[keep], None if self.probs is None else self.probs[keep])


@dataclass(frozen=True)
class Verification:
    logits: Tensor  # [N, K+1, V] float32 target logits at the last token and each draft
    features: Tensor | None  # [N, K+1, n*H] tapped target hidden states, if the plan taps any
    finite: Tensor | None = None  # [N] bool on the host: all of the row's logits finite (None: not yet known)

    def rows(self, keep: list[int]) -> "Verification":
        return Verification(self.logits[keep], None if self.features is None else self.features[keep],
                            None if self.finite is None else self.finite[keep])


def head_argmax(head: nn.Linear, hidden: Tensor) -> Tensor:
    """hidden [..., H] -> [...] int64: the greedy token of head(hidden) in the model's dtype."""
    return head(hidden).argmax(-1)


def block_window(last_token: Tensor, start: Tensor, fill: int, width: int) -> tuple[Tensor, Tensor]:
    """A block drafter's inputs (DFlash): ids [N, width], each row's last token then ``fill``
    (the mask token), and positions start .. start + width - 1."""
    offsets = torch.arange(width, device=start.device)
    ids = torch.where(offsets == 0, last_token[:, None], fill)  # [N, width]
    return ids, start[:, None] + offsets


@dataclass(frozen=True)
class DraftRows:
    """The rows a drafter drafts for, as device tensors: what a graph-captured draft step reads."""

    last_token: Tensor  # [N] int64, the token each row's round starts from
    start: Tensor  # [N] int64, its position (seq_len - 1)
    batch: SamplingBatch  # per-row sampling parameters
    caches: Any  # the KVStore's handle on these rows' drafter caches
    target_kv: "TargetKV | None" = None  # the target's own cache, read-only (drafters that share it)
    features: Tensor | None = None  # [N, taps*H] target features at position start - 1 (Drafter.reads_last_features)
    # the backend's greedy readout through an LM head (the cuda backend's never writes logits)
    head_argmax: Callable[[nn.Linear, Tensor], Tensor] = head_argmax
    # the backend's block_window (the cuda backend's is one launch)
    block_window: Callable[[Tensor, Tensor, int, int], tuple[Tensor, Tensor]] = block_window


class TargetKV(Protocol):
    """Read-only access to the target's KV cache for the rows of a draft step."""

    def read(self, layer: int, q: Tensor) -> Tensor:
        """q [N, Hq, T, D] (rotated) over each row's verified keys of target layer ``layer``
        (positions 0 .. start - 1), with no mask among them; nothing is stored -> [N, Hq, T, D]."""


class KVStore(Protocol):
    """Per-request KV caches a backend lends to drafters that own one."""

    def new(self, num_layers: int) -> Any: ...

    def append(self, cache: Any, layer: int, k: Tensor, v: Tensor) -> None:
        """k, v [Hkv, C, D] appended at the cache's end."""

    def length(self, cache: Any) -> int: ...

    def truncate(self, cache: Any, length: int) -> None: ...

    def attention(self, caches: Any, causal: bool, persist: bool) -> AttentionFn:
        """Attention of each row's new q/k/v over its cache then its new k/v. ``caches`` is a
        list of ``new()`` handles, or a backend's batched handle (DraftRows.caches)."""

    # Stores that index KV by absolute position (the cuda backend's static caches) also offer
    # write_projected(caches, layers, x [N, W, *], positions [N, W], rotary, fc=None, hidden_norm=None):
    # every DecoderLayer's k/v projection of x, or of hidden_norm(fc(x)) (k-norm, RoPE), at each
    # row's positions start .. start+W-1; and at(caches, start [N]) -> the same rows' handle with
    # new keys going at ``start``.


class Backend(Protocol):
    name: str

    def prefill(self, reqs: list[Request]) -> list[int | None]:
        """Run the target over each prompt, prime the drafter; return each first token
        (None for a request whose logits were not finite)."""

    def draft(self, reqs: list[Request]) -> Proposal: ...

    def skip_draft(self, reqs: list[Request]) -> Proposal:
        """An empty proposal: this round is a plain decode step."""

    def verify(self, reqs: list[Request], proposal: Proposal) -> Verification: ...

    def accept(self, reqs: list[Request], proposal: Proposal, verification: Verification) -> Verdict:
        """Decide the round and keep the accepted positions' KV and drafter context."""

    def free(self, req: Request) -> None: ...
