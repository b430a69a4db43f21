"""The operations every model's forward is written in, and the per-forward context they read.

A model in core/models/ has one forward, written over ``Ops``; a backend supplies them: the
reference backend (and training) eager PyTorch, the definition of correct (eager.py), the cuda
backend fused Triton kernels. Two conventions let a fused implementation keep its fusions:
- a linear's result is opaque (``Partial``) between the linear and the norm or the attention
  that reads it: the cuda backend may leave float32 partial sums there, which the norm adds as
  it loads;
- a block's residual add is deferred into the next norm (``add_norm``), whose kernel writes the
  sum, which is then also the layer's output hidden state: a tapped layer's sum is written
  straight into its columns of the features (``Taps``).
Activations are [N, W, H]: N rows (requests), W new tokens a row, at ``Forward.positions``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

# a linear's result, as only norm, add_norm and attention read it (the cuda backend's: whole
# values or float32 partial sums [parts, N*W, out])
Partial = Tensor


@dataclass(frozen=True)
class Forward:
    """One forward's context: where its rows stand, which keys it stores and reads (the
    backend's handle, ``kv``, with their mask: causal, a block over a context, frozen keys of
    another model, sliding windows), whether a row's results must not depend on its batch, and
    where tapped layers' outputs go."""

    positions: Tensor  # [N, W] int64: each row's new tokens' positions
    # the backend's handle on this forward's keys: the reference's an AttentionFn, called with a
    # layer's rotated q [N, Hq, W, D] and new k, v [N, Hkv, W, D] (None: a query-only layer)
    # -> [N, Hq, W, D], with ``append(layer, k, v)`` for store_kv; the cuda backend's a view of
    # its caches (rows' slots, key counts, pages, mask)
    kv: Any
    taps: tuple[int, ...] = ()  # layers whose output hidden states are gathered (-1: the embedding output)
    # called with the features [N, W, len(taps) * H] as soon as the last tapped layer's output is
    # written, before the layers after it run: work that reads only them may start there
    on_tapped: Callable[[Tensor], None] | None = None
    invariant: bool = False  # a row's results independent of the rows beside it (batch-invariant kernels)

    def with_positions(self, positions: Tensor) -> "Forward":
        """The same keys' handle for other new positions (an append-only store's next chain step)."""
        return Forward(positions, self.kv, self.taps, self.on_tapped, self.invariant)


class Ops(Protocol):
    """What a forward needs. ``norm`` arguments are RMSNorm modules, ``module`` arguments the
    model's own nn.Modules (a backend reads their weights its own way); ``rotary`` a Rotary."""

    in_place_taps: bool  # add_norm writes a tapped layer's sum into ``out`` (Taps)

    def embed(self, table: Tensor, ids: Tensor) -> Tensor:
        """Rows of ``table`` [V, H] for ids [N, W] -> [N, W, H]."""

    def embed_beside(self, table: Tensor, ids: Tensor, scale: float, other: Tensor) -> Tensor:
        """[table[ids] * scale, other] -> [N, W, H + F] (a frozen-KV MTP step's input)."""

    def normed_beside(self, table: Tensor, ids: Tensor, norm_a: nn.Module, other: Tensor, norm_b: nn.Module) -> Tensor:
        """[norm_a(table[ids]), norm_b(other)] -> [N, W, 2H] (an EAGLE-3 step's input)."""

    def linear(self, fwd: Forward, x: Tensor, module: nn.Linear) -> Partial:
        """module(x) for x [N, W, K], as a Partial for a norm or the residual add."""

    def project(self, x: Tensor, module: nn.Linear) -> Tensor:
        """module(x) -> [..., out] whole values (a forward's output, a hidden state fed on)."""

    def gated(self, fwd: Forward, x: Tensor, mlp: nn.Module) -> Tensor:
        """silu(mlp.gate_proj(x)) * mlp.up_proj(x) -> [N, W, I]."""

    def norm(self, fwd: Forward, x: Partial, norm: nn.Module) -> Tensor:
        """norm(x) -> [N, W, H], x a tensor or a Partial."""

    def add_norm(self, fwd: Forward, partial: Partial | None, residual: Tensor | None, norm: nn.Module,
                 out: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """s = residual + partial (either alone where the other is None) -> (s, norm(s)); where
        ``partial`` is given, s is written into ``out`` [N*W, H] (a view: a tapped layer's
        columns) when given."""

    def attention(self, fwd: Forward, layer: int, module: nn.Module, x: Tensor, rotary: nn.Module) -> Tensor:
        """A layer's attention from its normed input x [N, W, In]: q/k/v projections, per-head
        q/k norms, RoPE at fwd.positions, the new keys stored as fwd.kv says (none for a
        query-only module), attention by fwd.kv's mask -> [N, W, Hq * D] (before o_proj)."""

    def store_kv(self, fwd: Forward, layer: int, module: nn.Module, x: Tensor, rotary: nn.Module) -> None:
        """Only the keys and values of x [N, W, H] (k norm, RoPE), stored at fwd.positions (a
        DFlash drafter's context)."""

    def logits(self, head: nn.Linear, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> float32 logits [..., V], rounded through the model's dtype."""

    def argmax(self, head: nn.Linear, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> [...] int64, the first largest of head(hidden) (no logits kept)."""

    def draw(self, probs: Tensor, seed: Tensor, position: Tensor, stream: int) -> Tensor:
        """A seeded draw from probs [N, V] at each row's (seed, position) [N] int64 and ``stream``
        -> ids [N] int64 (a drafter's draft from its q): core.sampling.sample's draw, its keyed noise
        exactly (a float32 log may differ by an ulp, which moves a draw only at a near-tie)."""

    def block_window(self, last_token: Tensor, start: Tensor, fill: int, width: int) -> tuple[Tensor, Tensor]:
        """A block drafter's inputs: ids [N, width] (each row's last token, then ``fill``) and
        positions start .. start + width - 1 [N, width]."""


class Taps:
    """Where a stack's tapped layers' outputs go. With ``in_place`` (the ops write each tapped
    sum where ``out`` says: Ops.add_norm) they are the columns of one features tensor [N*W,
    len(taps) * H], a layer's where it is first named (a layer named twice is copied at the end,
    -1, the embedding output, at the start); else the outputs handed to ``keep`` are
    concatenated at the end (eager, autograd-safe). ``done``: the layer whose opening add_norm
    writes the last tapped output, after which ``finish`` hands the features on."""

    def __init__(self, fwd: Forward, h: Tensor, in_place: bool):
        n, w = fwd.positions.shape
        width, taps = h.shape[-1], fwd.taps
        self.fwd, self.shape, self.kept = fwd, (n, w), {-1: h}
        self.done = max(taps, default=-1) + 1
        self.features = torch.empty(n * w, len(taps) * width, dtype=h.dtype, device=h.device) \
            if taps and in_place else None
        self.first: dict[int, Tensor] = {}
        if self.features is not None:
            cols = [self.features[:, j * width : (j + 1) * width] for j in range(len(taps))]  # [N*W, H] views
            self.first = {t: cols[taps.index(t)] for t in taps}
            if -1 in self.first:  # no add_norm writes the embedding output
                self.first[-1].copy_(h.reshape(n * w, width))

    def out(self, layer: int) -> Tensor | None:
        return self.first.get(layer)

    def keep(self, layer: int, h: Tensor) -> None:
        """Layer ``layer``'s output (written in place already, or kept to be concatenated)."""
        if self.features is None and layer in self.fwd.taps:
            self.kept[layer] = h

    def finish(self) -> None:
        taps = self.fwd.taps
        if not taps:
            return
        if self.features is None:
            self.features = torch.cat([self.kept[t].reshape(self.shape[0] * self.shape[1], -1) for t in taps], dim=-1)
        else:
            width = self.features.shape[1] // len(taps)
            for j, t in enumerate(taps):
                if taps.index(t) != j:  # a layer tapped twice
                    self.features[:, j * width : (j + 1) * width].copy_(self.first[t])
        if self.fwd.on_tapped is not None:
            self.fwd.on_tapped(self.result())

    def result(self) -> Tensor | None:
        return None if self.features is None else self.features.view(*self.shape, -1)
