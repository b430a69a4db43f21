"""LM-head readouts: float32 logits rounded through the model dtype, a greedy argmax that
writes no logits (folded into the matvec), and the verify head's draws folded beside its logits
(matvec.py)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from .linear import product
from .matvec import MAX_ROWS, ArgmaxScratch, Draw, Tiling, choose_tiling, invariant_tiling, matvec, matvec_argmax, \
    matvec_draw


def lm_logits(lm_head: torch.nn.Linear, hidden: Tensor, invariant: bool = False) -> Tensor:
    """hidden [..., H] -> float32 logits [..., V], rounded through the model dtype as the
    target's own logits() are (draftline.core.models.target)."""
    if lm_head.bias is not None:
        return lm_head(hidden).float()
    flat = hidden.reshape(-1, hidden.shape[-1])
    whole = _head_tiling(lm_head, flat, True, most=flat.shape[0]) if invariant else None
    if whole is not None:  # the sums head_draw folds (split 1): a row's logits are the same bits in either round
        return matvec(flat, lm_head.weight, whole, out_dtype=torch.float32, invariant=True).view(
            *hidden.shape[:-1], -1)
    out = product(flat, lm_head.weight, out_dtype=torch.float32, invariant=invariant)
    if out.dim() == 3:  # partial sums
        out = out.sum(0).to(hidden.dtype)
    return out.float().view(*hidden.shape[:-1], -1)


def head_argmax(head: torch.nn.Linear, hidden: Tensor, scratch: ArgmaxScratch | None = None) -> Tensor:
    """hidden [..., H] -> [...] int64: argmax of head(hidden) (the first on ties), the products
    rounded to the model dtype as the eager head gives them; no logits are written. The cuda
    backend binds its persistent ``scratch`` (matvec.ArgmaxScratch)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    tiling = _head_tiling(head, flat)
    if tiling is None and head.bias is None:  # no fold (past one row tile: a DFlash block): product, then argmax
        return row_argmax(F.linear(flat, head.weight)).view(hidden.shape[:-1])
    if tiling is None:
        return head(hidden).argmax(-1)
    return matvec_argmax(flat, head.weight, tiling, scratch).view(hidden.shape[:-1])


@triton.jit
def _row_argmax_kernel(x, out, N, stride, BLOCK: tl.constexpr):
    """Row r of x: torch.argmax's answer, the first largest value, a NaN counting as largest."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    best = tl.full((), float("-inf"), tl.float32)
    where = tl.full((), 0, tl.int64)
    first_nan = tl.full((), N, tl.int64)
    for start in range(0, N, BLOCK):
        c = start + cols
        v = tl.load(x + r * stride + c, mask=c < N, other=float("-inf")).to(tl.float32)
        nan = v != v
        first_nan = tl.minimum(first_nan, tl.min(tl.where(nan, c, N), axis=0))
        top = tl.max(tl.where(nan, float("-inf"), v), axis=0)
        at = tl.min(tl.where(v == top, c, N), axis=0)
        where = tl.where(top > best, at, where)  # an equal value in a later block is not first
        best = tl.maximum(best, top)
    tl.store(out + r, tl.where(first_nan < N, first_nan, where))


def row_argmax(x: Tensor) -> Tensor:
    """x [M, N] -> [M] int64, as x.argmax(-1) gives it, in one launch of a program a row (the
    library's reduction over a 16-row DFlash block's logits took several launches' time)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    if x.shape[0]:
        block = min(4096, triton.next_power_of_2(x.shape[1]))
        _row_argmax_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), BLOCK=block)
    return out


def head_draw(head: torch.nn.Linear, hidden: Tensor, scratch: ArgmaxScratch, draw: Draw,
              invariant: bool = False) -> Tensor | None:
    """hidden [N, W, H] -> float32 logits [N, W, V], as lm_logits gives them, in one launch
    that also leaves each row's draw from them (as sampling.accept_matching makes it) and its
    count of non-finite logits in ``scratch`` for the next kernel (matvec.take_draws); None
    where the head is not one whole-sum matvec (the caller then draws from lm_logits)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    tiling = _head_tiling(head, flat, invariant, most=scratch.rows)
    if tiling is None:
        return None
    return matvec_draw(flat, head.weight, tiling, scratch, draw, invariant).view(*hidden.shape[:-1], -1)


def _head_tiling(head: torch.nn.Linear, flat: Tensor, invariant: bool = False, most: int = MAX_ROWS
                 ) -> Tiling | None:
    """The tiling of an LM head over rows flat [M, H] when one whole-sum matvec launch can fold
    its readout (no bias, the decode matvec applies, at most ``most`` rows: an argmax's last
    program unpacks one row tile, a draw's scratch holds its rows), else None. The K split a
    small head would get is dropped: a fold needs whole sums, and one launch serves where the
    matrix library's product and a separate reduction took two (a tiny pair's 4096-token head)."""
    n, k = head.weight.shape
    tiling = invariant_tiling(n, k) if invariant else choose_tiling(flat.shape[0], n, k)
    if head.bias is not None or tiling is None or flat.shape[0] > most:
        return None
    return replace(tiling, split=1)


