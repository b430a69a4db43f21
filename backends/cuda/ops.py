"""The cuda backend's operations (core.models.ops.Ops): the same math as the eager ones, in
fused Triton kernels. A decoder layer is eight or nine launches instead of about sixty: add +
RMSNorm (norm.py), the q/k/v matvec (linear.py), q/k-norm + RoPE + K/V store (qkv.py),
attention by the forward's mask (views.py), the output matvec, add + RMSNorm, the gate-up
matvec writing SiLU·up, the down matvec. A matvec may leave float32 partial sums, which the
norm and q/k/v kernels add as they load; the residual add is deferred into the next norm, which
writes a tapped layer's output straight into its columns of the features."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from draftline.core.models.fp8 import Fp8Linear
from draftline.core.models.ops import Forward, Partial

from . import sampling as kernels
from .embedding import embed_beside, normed_beside
from .fp8 import Fp8Weight
from .head import head_argmax
from .linear import linear
from .matvec import ArgmaxScratch
from .norm import add_norm, norm
from .qkv import project_heads
from .views import FROZEN
from .windows import block_window


class CudaOps:
    in_place_taps = True

    def __init__(self, scratch: ArgmaxScratch | None = None):
        self.scratch = scratch  # the greedy readouts' state between launches (matvec.ArgmaxScratch)

    def embed(self, table: Tensor, ids: Tensor) -> Tensor:
        return table[ids]

    def embed_beside(self, table: Tensor, ids: Tensor, scale: float, other: Tensor) -> Tensor:
        return embed_beside(table, ids, scale, other)

    def normed_beside(self, table: Tensor, ids: Tensor, norm_a: nn.Module, other: Tensor, norm_b: nn.Module) -> Tensor:
        return normed_beside(table, ids, norm_a, other, norm_b)

    def linear(self, fwd: Forward, x: Tensor, module: nn.Module) -> Partial:
        if isinstance(module, Fp8Linear):
            return self._product(fwd, x, module.packed, None)
        return self._product(fwd, x, module.weight, module.bias)

    def project(self, x: Tensor, module: nn.Linear) -> Tensor:
        return F.linear(x, module.weight, module.bias)

    def gated(self, fwd: Forward, x: Tensor, mlp: nn.Module) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        return linear(flat, mlp.fused_gate_up, gated=True, invariant=fwd.invariant).view(*x.shape[:-1], -1)

    def norm(self, fwd: Forward, x: Partial, module: nn.Module) -> Tensor:
        rows = fwd.positions.numel()
        if x.numel() == rows * module.weight.shape[0] and not x.is_contiguous():
            x = x.contiguous()  # a view's rows (a tap's columns): the kernel reads rows H apart
        return norm(x, module.weight, module.eps, rows).view(*fwd.positions.shape, -1)

    def add_norm(self, fwd: Forward, partial: Partial | None, residual: Tensor | None, module: nn.Module,
                 out: Tensor | None = None) -> tuple[Tensor, Tensor]:
        n, w = fwd.positions.shape
        if residual is None:  # the sum is the partial's, kept: a residual stream's start
            kept = partial.new_empty(n * w, module.weight.shape[0], dtype=module.weight.dtype)
            normed = norm(partial, module.weight, module.eps, n * w, keep=kept)
            return kept.view(n, w, -1), normed.view(n, w, -1)
        return add_norm(partial, residual, module.weight, module.eps, out=out, invariant=fwd.invariant)

    def attention(self, fwd: Forward, layer: int, module: nn.Module, x: Tensor, rotary: nn.Module) -> Tensor:
        view, (n, w) = fwd.kv, fwd.positions.shape
        if view.mask == FROZEN:  # queries only, over another model's keys
            proj = self._product(fwd, x, module.q_proj.weight, module.q_proj.bias)
            q = project_heads(module, proj, fwd.positions, rotary, view.cache, 0, view.slots, view.kv_len,
                              keys=False)
        else:
            proj = self._product(fwd, x, module.fused_qkv, module.fused_qkv_bias)
            q = project_heads(module, proj, fwd.positions, rotary, view.cache, layer, view.slots, view.kv_len)
        return view.attend(q, layer).transpose(1, 2).reshape(n, w, -1)  # [N, W, Hq * D]

    def store_kv(self, fwd: Forward, layer: int, module: nn.Module, x: Tensor, rotary: nn.Module) -> None:
        view, rows = fwd.kv, module.num_heads * module.head_dim
        bias = None if module.fused_qkv_bias is None else module.fused_qkv_bias[rows:]
        weight = module.fused_qkv
        weight = weight.rows_from(rows) if isinstance(weight, Fp8Weight) else weight[rows:]
        proj = self._product(fwd, x, weight, bias)  # [N*W, 2 Hkv D]: k rows, then v rows
        project_heads(module, proj, fwd.positions, rotary, view.cache, layer, view.slots, view.kv_len, queries=False)

    def logits(self, head: nn.Linear, hidden: Tensor) -> Tensor:
        return head(hidden).float()

    def argmax(self, head: nn.Linear, hidden: Tensor) -> Tensor:
        return head_argmax(head, hidden, self.scratch)

    def draw(self, probs: Tensor, seed: Tensor, position: Tensor, stream: int) -> Tensor:
        return kernels.draw(probs, seed, position, stream)

    def block_window(self, last_token: Tensor, start: Tensor, fill: int, width: int) -> tuple[Tensor, Tensor]:
        return block_window(last_token, start, fill, width)

    @staticmethod
    def _product(fwd: Forward, x: Tensor, weight: Tensor | Fp8Weight, bias: Tensor | None) -> Partial:
        """x [..., K] @ weight.T: the matvec (maybe partial sums) where it applies; with a bias,
        whole values through the matrix library."""
        flat = x.reshape(-1, x.shape[-1])
        if bias is not None:
            return F.linear(flat, weight, bias)
        return linear(flat, weight, invariant=fwd.invariant)
