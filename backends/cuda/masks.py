"""Token masks on the device: each constrained row's grammar as a bitmask per verify slot (bit
t % 32 of word t // 32 set: token t allowed), applied to the verify's logits inside the round's
graph, before the graph decides the round. The host fills the masks (core.walk.fill_masks:
slot j after the drafts before it) into a pinned buffer and copies them, without waiting, into
the persistent one the graphs read."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from draftline.core.walk import fill_masks
from draftline.core.request import Request

from . import events

BLOCK = 1024  # vocabulary columns a program masks


@triton.jit
def _mask_kernel(logits, bitmask, V, WORDS, BLOCK: tl.constexpr):
    """Program (row-slot, column block): its forbidden columns' logits set to -inf."""
    r, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    inside = cols < V
    words = tl.load(bitmask + r * WORDS + cols // 32, mask=inside, other=-1)
    allowed = ((words >> (cols % 32)) & 1) != 0  # an arithmetic shift leaves bit k at 0 all the same
    tl.store(logits + r * V + cols, tl.full((BLOCK,), float("-inf"), tl.float32), mask=inside & ~allowed)


def apply_masks(logits: Tensor, bitmask: Tensor) -> None:
    """logits [N, W, V] float32 (contiguous), masked in place by bitmask [N, W, ceil(V / 32)] int32."""
    n, w, v = logits.shape
    if not logits.is_contiguous() or logits.dtype != torch.float32 or bitmask.shape != (n, w, triton.cdiv(v, 32)):
        raise ValueError(f"apply_masks: logits {tuple(logits.shape)} {logits.dtype} against a bitmask "
                         f"{tuple(bitmask.shape)}: want contiguous float32 logits and [N, W, ceil(V / 32)] words")
    _mask_kernel[(n * w, triton.cdiv(v, BLOCK))](logits, bitmask.contiguous(), v, bitmask.shape[-1], BLOCK=BLOCK)


class TokenMasks:
    """The masks a graph reads: a round of ``bucket`` rows and ``width`` slots reads the first
    bucket * width * words int32 of ``device`` as [bucket, width, words] (contiguous, so a
    round moves and masks only its own), all allowed until a constrained round loads its rows'."""

    def __init__(self, max_batch: int, width: int, vocab: int, device: torch.device):
        self.words = triton.cdiv(vocab, 32)
        size = max_batch * width * self.words
        self.device = torch.full((size,), -1, dtype=torch.int32, device=device)
        pinned = device.type == "cuda"
        self._host = torch.full((size,), -1, dtype=torch.int32, pin_memory=pinned)
        self._copied = torch.cuda.Event() if pinned else None  # the last copy has read the host buffer
        self._index = events.device_index(device) if pinned else -1

    def load(self, reqs: list[Request], drafts: list[list[int]] | None, bucket: int, width: int,
             choosers: list | None = None) -> tuple[bool, bool]:
        """The rows' masks for a round of ``width`` slots (``drafts`` [n][width - 1] on the host,
        None for a plain round; chosen in place by ``choosers``, each row walked as far as its
        grammar's reach: core.walk.fill_masks),
        padding rows up to ``bucket`` all allowed, copied to the device view [bucket, width,
        words] the round's graph reads -> (whether any draft changed, whether any changed
        before its row's cut: fill_masks)."""
        if self._copied is not None:
            self._copied.synchronize()
        size = bucket * width * self.words
        changed = fill_masks(reqs, drafts, self._host[:size].view(bucket, width, self.words), choosers)
        self.device[:size].copy_(self._host[:size], non_blocking=self._copied is not None)
        if self._copied is not None:
            events.record(self._copied, self._index)
        return changed

    def view(self, bucket: int, width: int) -> Tensor:
        return self.device[: bucket * width * self.words].view(bucket, width, self.words)
