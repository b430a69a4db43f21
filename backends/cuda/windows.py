"""The ids and positions a step runs over, built on the device in one launch each: the verify
window [last token, drafts] and the DFlash block [last token, mask, ...]. Inside a captured
graph a handful of small PyTorch ops (arange, compare, where, add) cost a launch apiece."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _verify_kernel(meta, drafts, ids, positions, ends, stride_meta, K, W, LAST_ROW: tl.constexpr,
                   START_ROW: tl.constexpr, BLOCK: tl.constexpr):
    """Row n's verify window: ids [last token, drafts], positions start .. start + W - 1, and
    its key count after them, start + W."""
    n = tl.program_id(0)
    t = tl.arange(0, BLOCK)
    last = tl.load(meta + LAST_ROW * stride_meta + n)
    start = tl.load(meta + START_ROW * stride_meta + n)
    draft = tl.load(drafts + n * K + t - 1, mask=(t > 0) & (t < W), other=0)
    tl.store(ids + n * W + t, tl.where(t == 0, last, draft), mask=t < W)
    tl.store(positions + n * W + t, start + t, mask=t < W)
    tl.store(ends + n, start + W)


@triton.jit
def _block_kernel(last_token, start, ids, positions, fill, W, BLOCK: tl.constexpr):
    """Row n's DFlash block: ids [last token, fill, ..., fill], positions start .. start + W - 1."""
    n = tl.program_id(0)
    t = tl.arange(0, BLOCK)
    last = tl.load(last_token + n)
    tl.store(ids + n * W + t, tl.where(t == 0, last, fill), mask=t < W)
    tl.store(positions + n * W + t, tl.load(start + n) + t, mask=t < W)


def verify_window(meta: Tensor, drafts: Tensor, rows: int, width: int, last_row: int, start_row: int
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """ids, positions [rows, width] and ends [rows] (start + width: the rows' key counts after
    the window, Rows.end, so no forward adds them), int64, from the buffers' meta [fields,
    max_batch] (each row's last token and start in rows ``last_row`` and ``start_row``) and
    drafts [max_batch, K]."""
    ids = torch.empty(rows, width, dtype=torch.int64, device=meta.device)  # [rows, W]
    positions = torch.empty_like(ids)  # [rows, W]
    ends = torch.empty(rows, dtype=torch.int64, device=meta.device)  # [rows]
    _verify_kernel[(rows,)](meta, drafts, ids, positions, ends, meta.stride(0), drafts.shape[1], width,
                            LAST_ROW=last_row, START_ROW=start_row, BLOCK=triton.next_power_of_2(width))
    return ids, positions, ends


def block_window(last_token: Tensor, start: Tensor, fill: int, width: int) -> tuple[Tensor, Tensor]:
    """The DraftRows.block_window of the cuda backend: draftline.core.contract.block_window in one launch."""
    rows = last_token.shape[0]
    ids = torch.empty(rows, width, dtype=torch.int64, device=last_token.device)  # [N, W]
    positions = torch.empty_like(ids)  # [N, W]
    _block_kernel[(rows,)](last_token, start, ids, positions, fill, width, BLOCK=triton.next_power_of_2(width))
    return ids, positions
