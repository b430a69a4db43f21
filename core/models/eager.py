"""The operations as plain PyTorch over the models' own modules: what every other
implementation must compute. The reference backend runs these, and so does training.

``out`` (add_norm) is ignored: tapped outputs are concatenated (ops.Taps). Attention goes
through ``Forward.kv``, an AttentionFn: the layer's rotated q [N, Hq, W, D] and
its new k, v [N, Hkv, W, D] (None for a query-only layer) -> [N, Hq, W, D]; the callee owns the
mask and the cache. ``store_kv`` hands a layer's k and v to ``Forward.kv.append``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..sampling import sample
from .layers import rotate
from .ops import Forward, Partial


def heads(x: Tensor, n: int, d: int) -> Tensor:
    """[B, T, n*d] -> [B, n, T, d]."""
    b, t, _ = x.shape
    return x.view(b, t, n, d).transpose(1, 2)


def project_kv(module: nn.Module, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """x [B, T, H] -> rotated k, v [B, Hkv, T, D] (k-norm before RoPE)."""
    k = heads(module.k_proj(x), module.num_kv_heads, module.head_dim)
    k_norm = getattr(module, "k_norm", None)
    if k_norm is not None:
        k = k_norm(k)
    return rotate(k, cos, sin), heads(module.v_proj(x), module.num_kv_heads, module.head_dim)


class EagerOps:
    """core.models.ops.Ops in eager PyTorch."""

    in_place_taps = False  # tapped outputs are concatenated at the end (autograd-safe)

    def embed(self, table: Tensor, ids: Tensor) -> Tensor:
        return table[ids]

    def embed_beside(self, table: Tensor, ids: Tensor, scale: float, other: Tensor) -> Tensor:
        return torch.cat([table[ids] * scale, other], dim=-1)

    def normed_beside(self, table: Tensor, ids: Tensor, norm_a: nn.Module, other: Tensor, norm_b: nn.Module) -> Tensor:
        return torch.cat([norm_a(table[ids]), norm_b(other)], dim=-1)

    def linear(self, fwd: Forward, x: Tensor, module: nn.Linear) -> Partial:
        return module(x)

    def project(self, x: Tensor, module: nn.Linear) -> Tensor:
        return module(x)

    def gated(self, fwd: Forward, x: Tensor, mlp: nn.Module) -> Tensor:
        return F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)

    def norm(self, fwd: Forward, x: Partial, norm: nn.Module) -> Tensor:
        return norm(x)

    def add_norm(self, fwd: Forward, partial: Partial | None, residual: Tensor | None, norm: nn.Module,
                 out: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if partial is None:
            return residual, norm(residual)
        total = partial if residual is None else residual + partial
        return total, norm(total)

    def attention(self, fwd: Forward, layer: int, module: nn.Module, x: Tensor, rotary: nn.Module) -> Tensor:
        cos, sin = rotary(fwd.positions, x.dtype)
        q = heads(module.q_proj(x), module.num_heads, module.head_dim)
        q_norm = getattr(module, "q_norm", None)
        if q_norm is not None:
            q = q_norm(q)
        k = v = None
        if getattr(module, "k_proj", None) is not None:  # a query-only layer reads another model's keys
            k, v = project_kv(module, x, cos, sin)
        out = fwd.kv(layer, rotate(q, cos, sin), k, v)  # [B, Hq, T, D]
        b, _, t, _ = out.shape
        return out.transpose(1, 2).reshape(b, t, -1)

    def store_kv(self, fwd: Forward, layer: int, module: nn.Module, x: Tensor, rotary: nn.Module) -> None:
        cos, sin = rotary(fwd.positions, x.dtype)
        fwd.kv.append(layer, *project_kv(module, x, cos, sin))

    def logits(self, head: nn.Linear, hidden: Tensor) -> Tensor:
        return head(hidden).float()

    def argmax(self, head: nn.Linear, hidden: Tensor) -> Tensor:
        return head(hidden).argmax(-1)

    def draw(self, probs: Tensor, seed: Tensor, position: Tensor, stream: int) -> Tensor:
        return sample(probs, seed, position, stream)

    def block_window(self, last_token: Tensor, start: Tensor, fill: int, width: int) -> tuple[Tensor, Tensor]:
        offsets = torch.arange(width, device=start.device)
        ids = torch.where(offsets == 0, last_token[:, None], fill)  # [N, width]
        return ids, start[:, None] + offsets


EAGER = EagerOps()
