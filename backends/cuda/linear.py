"""A linear layer's product: the decode matvec up to its rows (matvec.py; a result that may be
float32 partial sums, which the norms and the q/k/v kernel add as they load), the matrix
library past them, the gated MLP's SiLU·up inside the matvec (or one launch after the
library's). q/k/v and gate/up weights are concatenated once (``fuse``): the modules' own
weights become views into them, so every path over the model shares one copy."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor, nn

from draftline.core.models.fp8 import Fp8Linear

from . import overlap
from .fp8 import Fp8Weight, fp8_product, pack
from .matvec import MAX_ROWS, WIDE_WEIGHTS, choose_tiling, invariant_tiling, matvec


@triton.jit
def _silu_mul_kernel(gu, out, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
    overlap.gate(PDL)
    r, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    inside = cols < I
    g = tl.load(gu + r * 2 * I + cols, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(gu + r * 2 * I + I + cols, mask=inside, other=0.0)
    silu = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    tl.store(out + r * I + cols, silu * u, mask=inside)


def linear(x: Tensor, weight: Tensor | Fp8Weight, gated: bool = False, out_dtype: torch.dtype | None = None,
           invariant: bool = False) -> Tensor:
    """x [M, K] @ weight.T through the decode matvec when it applies (the result may then be
    float32 partial sums [parts, M, N]: add_norm and the q/k/v kernel take those), else the
    matrix library. ``gated``: weight is [gate; up] and the result silu(gate) * up. Whole
    results are rounded to x's dtype, then stored as ``out_dtype`` when given. ``invariant``:
    the matvec at every M, its reductions fixed by the weight's shape (matvec.invariant_tiling),
    where the matrix library's algorithm would change with M; a launch-bound weight past the
    matvec's rows takes that form too (launch_bound). An Fp8Weight goes through fp8.py's product."""
    if isinstance(weight, Fp8Weight):
        return fp8_product(x, weight, gated, out_dtype, invariant)
    return product(x, weight, gated, out_dtype, invariant or launch_bound(x.shape[0], weight))


def product(x: Tensor, weight: Tensor, gated: bool = False, out_dtype: torch.dtype | None = None,
            invariant: bool = False) -> Tensor:
    """linear's product as asked: the decode matvec up to its rows, else the matrix library's
    (a small weight's too: one product, not partial sums, for callers that want whole values)."""
    n, k = weight.shape[0] // (2 if gated else 1), weight.shape[1]
    tiling = invariant_tiling(n, k, gated) if invariant else choose_tiling(x.shape[0], n, k, gated)
    if tiling is not None:
        return matvec(x, weight, tiling, gated, out_dtype, invariant=invariant)
    y = F.linear(x, weight)
    if gated:
        y = silu_mul(y)
    return y if out_dtype is None else y.to(out_dtype)


def launch_bound(m: int, weight: Tensor) -> bool:
    """Whether x [m, K] @ weight.T past the decode matvec's rows is a small model's product,
    whose launch costs what its work does: the invariant matvec's row tiles then serve it in
    one launch, the gated form's SiLU·up inside, where the matrix library took two (a tiny
    drafter's 16-token blocks at 16 rows: four layers' products a round), and past those rows a
    row's values do not change with M. A large weight's product is arithmetic-bound there: the
    library's."""
    return m > MAX_ROWS and weight.numel() < WIDE_WEIGHTS


def silu_mul(gu: Tensor) -> Tensor:
    rows, inter = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gu.dtype, device=gu.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gu, out, inter, BLOCK=block,
                                                        **overlap.launch(release=False))
    return out


def fuse(model: nn.Module) -> None:
    """Concatenate each attention module's q/k/v weights (``fused_qkv``, and ``fused_qkv_bias``
    where it has biases) and each MLP's gate/up weights (``fused_gate_up``) once: before any graph
    is captured, since fusing frees the old weights a graph would have baked in."""
    for m in model.modules():
        if _has(m, ("q_proj", "k_proj", "v_proj")) and getattr(m, "fused_qkv", None) is None:
            m.fused_qkv, m.fused_qkv_bias = _fuse([m.q_proj, m.k_proj, m.v_proj])
        if _has(m, ("gate_proj", "up_proj")) and getattr(m, "fused_gate_up", None) is None:
            m.fused_gate_up, _ = _fuse([m.gate_proj, m.up_proj])
        if isinstance(m, Fp8Linear) and getattr(m, "packed", None) is None:  # o and down: read alone
            m.packed = pack([m])


def _fuse(linears: list[nn.Module]) -> tuple[Tensor | Fp8Weight, Tensor | None]:
    """One weight (and bias) for several projections of the same input; each module's weight
    (and bias) becomes a view of it. FP8 projections stack into one Fp8Weight (no biases)."""
    if all(isinstance(lin, Fp8Linear) for lin in linears):
        return pack(linears), None
    fused = torch.cat([lin.weight.data for lin in linears])
    biased = all(lin.bias is not None for lin in linears)
    if not biased and any(lin.bias is not None for lin in linears):
        raise ValueError("projections of one input with and without biases")
    bias = torch.cat([lin.bias.data for lin in linears]) if biased else None
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = fused[start : start + rows]
        if bias is not None:
            lin.bias.data = bias[start : start + rows]
        start += rows
    return fused, bias


def _has(obj, names: tuple[str, ...]) -> bool:
    return all(isinstance(getattr(obj, name, None), (nn.Linear, Fp8Linear)) for name in names)
