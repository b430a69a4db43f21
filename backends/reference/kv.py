"""Per-request contiguous KV caches and the attention that reads them, with explicit masks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from draftline.core.models.eager import EAGER
from draftline.core.models.ops import Forward


@dataclass
class KVCache:
    """One request's cache for one model: per layer K and V of shape [Hkv, S, D]."""

    k: list[Tensor | None] = field(default_factory=list)
    v: list[Tensor | None] = field(default_factory=list)

    def length(self) -> int:
        return 0 if not self.k or self.k[0] is None else self.k[0].shape[1]


def attend(q: Tensor, k: Tensor, v: Tensor, causal: bool, window: int | None = None,
           anchor: int | None = None, block_causal: bool = False, per_query: bool = False) -> Tensor:
    """q [Hq, T, D] over k, v [Hkv, S, D] -> [Hq, T, D]. The T queries are the last T keys'
    positions; with ``causal`` each sees keys up to and including its own position, and with a
    sliding ``window`` only keys past min(own, anchor) - window: a query after ``anchor`` (a
    draft chain's later steps, anchored at its start) keeps the window its chain started with.
    Without ``causal`` (a block over a context) a window keeps the last ``window`` context keys
    before the block, and ``block_causal`` makes the block itself causal; with ``per_query``
    (the z-lab DFlash sliding layer) each query sees instead the ``window`` keys ending at its
    own position. Scores, softmax and the weighted sum run in float64, rounded once: a query's
    output then does not depend on how many queries or masked keys share the call (float32
    sums round by the shape), so a verify window computes what plain decoding does."""
    hq, t, d = q.shape
    hkv, s, _ = k.shape
    k = k.repeat_interleave(hq // hkv, dim=0)  # grouped-query: each KV head serves hq/hkv heads
    v = v.repeat_interleave(hq // hkv, dim=0)
    scores = (q.double() @ k.double().transpose(-1, -2)) * d**-0.5  # [Hq, T, S]
    if causal:
        own = torch.arange(s - t, s, device=q.device)[:, None]  # [T, 1] key index of each query
        keys = torch.arange(s, device=q.device)[None, :]
        visible = keys <= own  # [T, S]
        if window is not None:
            start = own if anchor is None else own.clamp(max=anchor)
            visible &= keys > start - window
        scores = scores.masked_fill(~visible, float("-inf"))
    elif window is not None:
        own = torch.arange(s - t, s, device=q.device)[:, None]  # [T, 1]
        keys = torch.arange(s, device=q.device)[None, :]
        visible = keys >= (s - t) - window  # [1, S]: the window ends where the block starts
        if per_query:
            visible = keys > own - window  # [T, S]: the window ends at the query
        if block_causal or per_query:
            visible = visible & (keys <= own)
        scores = scores.masked_fill(~visible, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.double()).to(q.dtype)


@dataclass(frozen=True)
class CachedAttention:
    """Attention for a batch whose row b attends over caches[b] followed by its new keys.

    ``persist`` appends the new keys to the cache (the target; the drafter's context); a DFlash
    block passes False so its keys are dropped after the round.
    """

    caches: list[KVCache]
    causal: bool
    persist: bool
    windows: dict[int, int] | None = None  # layer -> its sliding window (see attend); others: full
    anchor: int | None = None  # where the window of queries past it is measured from
    block_causal: bool = False  # non-causal attention: a windowed layer's block is causal
    per_query: bool = False  # non-causal attention: a windowed layer's queries see the window ending at them

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = []
        for b, cache in enumerate(self.caches):
            keys, values = k[b], v[b]
            if cache.k[layer] is not None:
                keys = torch.cat([cache.k[layer], keys], dim=1)
                values = torch.cat([cache.v[layer], values], dim=1)
            if self.persist:
                cache.k[layer], cache.v[layer] = keys, values
            window = (self.windows or {}).get(layer)
            out.append(attend(q[b], keys, values, self.causal, window, self.anchor, self.block_causal, self.per_query))
        return torch.stack(out)

    def append(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Keys and values [B, Hkv, T, D] stored with no query (a DFlash drafter's context)."""
        for b, cache in enumerate(self.caches):
            ReferenceKV.append(cache, layer, k[b], v[b])


class ReferenceKV:
    """The KVStore the reference backend lends to drafters (and uses for the target): per-request
    handles that grow as keys are appended, and the eager operations."""

    positional = False

    def __init__(self, ops=EAGER):
        self.ops = ops  # the eager operations (a tensor-parallel shard's all-reduce its row-parallel linears)

    def new(self, num_layers: int) -> KVCache:
        return KVCache(k=[None] * num_layers, v=[None] * num_layers)

    @staticmethod
    def append(cache: KVCache, layer: int, k: Tensor, v: Tensor) -> None:
        if cache.k[layer] is not None:
            k, v = torch.cat([cache.k[layer], k], dim=1), torch.cat([cache.v[layer], v], dim=1)
        cache.k[layer], cache.v[layer] = k, v

    def length(self, cache: KVCache) -> int:
        return cache.length()

    def truncate(self, cache: KVCache, length: int) -> None:
        cache.k = [None if t is None else t[:, :length] for t in cache.k]
        cache.v = [None if t is None else t[:, :length] for t in cache.v]

    def attention(self, caches: list[KVCache], causal: bool, persist: bool, windows: dict[int, int] | None = None,
                  anchor: int | None = None, block_causal: bool = False, per_query: bool = False
                  ) -> CachedAttention:
        return CachedAttention(caches, causal, persist, windows, anchor, block_causal, per_query)

    def forward(self, caches: list[KVCache], positions: Tensor, causal: bool, persist: bool = True,
                windows: dict[int, int] | None = None, anchor: int | None = None, block_causal: bool = False,
                per_query: bool = False, end: Tensor | None = None) -> Forward:
        """A forward whose new keys go at each handle's end (kept where ``persist``)."""
        return Forward(positions, self.attention(caches, causal, persist, windows, anchor, block_causal, per_query))


@dataclass(frozen=True)
class FrozenTargetKV:
    """TargetKV over the reference backend's per-request target caches (after accept() they
    hold exactly the verified positions)."""

    caches: list[KVCache]
    gather: Callable[[Tensor], Tensor] | None = None  # a shard's KV heads -> every rank's (tensor parallel)

    def read(self, layer: int, q: Tensor) -> Tensor:
        """q [N, Hq, T, D] over each row's cached keys of ``layer``, unmasked -> [N, Hq, T, D]."""
        whole = self.gather or (lambda t: t)
        return torch.stack([attend(q[b], whole(c.k[layer]), whole(c.v[layer]), causal=False)
                            for b, c in enumerate(self.caches)])

    def forward(self, positions: Tensor, layer: int) -> Forward:
        return Forward(positions, lambda own, q, k, v: self.read(layer, q))
