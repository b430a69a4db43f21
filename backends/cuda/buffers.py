"""The one owner of the cuda backend's persistent device buffers.

Each request's place in its sequence lives on the device, by KV slot (``state``: its last
token and that token's position), so a round starts where the last round launched for the
slot left it, whether or not the host has read that round yet. So do its sampling parameters
(``params``, ``fparams``), which its prefill writes. A round's rows (their slots) are copied
in only when they change; every graph opens by gathering the rows' last token, start and
sampling parameters from their slots. The padding rows of a bucket point at the caches'
scratch slot, whose state is never written, so they stay at position 0, greedy.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from draftline.core.request import Request
from draftline.core.sampling import SamplingBatch

from . import events
from .matvec import MAX_ROWS, ArgmaxScratch

# rows of Buffers.meta (int64) and Buffers.fmeta (float32); LAST and START are gathered from state
LAST, START, SLOT, DRAFT_SLOT, SEED, TOP_K = range(6)
TEMPERATURE, TOP_P, INV_TEMP = range(3)
STAGING = 4  # host staging buffers for row loads, so a load rarely waits for an earlier copy


@triton.jit
def _gather_kernel(meta, fmeta, state, slot_ints, slot_floats, stride_meta, stride_fmeta, stride_state, stride_ints,
                   stride_floats, LAST_ROW: tl.constexpr, START_ROW: tl.constexpr, SLOT_ROW: tl.constexpr,
                   SEED_ROW: tl.constexpr, FLOATS: tl.constexpr):
    """Row n's last token, start and sampling parameters (seed, top-k; temperature, top-p and
    inverse temperature), from its slot's. (No argument is named ``params``: Triton 3.6's
    argument binder has a name of its own so called.)"""
    n = tl.program_id(0)
    slot = tl.load(meta + SLOT_ROW * stride_meta + n)
    tl.store(meta + LAST_ROW * stride_meta + n, tl.load(state + slot))
    tl.store(meta + START_ROW * stride_meta + n, tl.load(state + stride_state + slot))
    tl.store(meta + SEED_ROW * stride_meta + n, tl.load(slot_ints + slot))
    tl.store(meta + (SEED_ROW + 1) * stride_meta + n, tl.load(slot_ints + stride_ints + slot))
    for f in tl.static_range(FLOATS):
        tl.store(fmeta + f * stride_fmeta + n, tl.load(slot_floats + f * stride_floats + slot))


class Buffers:
    def __init__(self, max_batch: int, num_drafts: int, scratch: int, device: torch.device,
                 argmax: ArgmaxScratch | None = None):
        self.max_batch, self.scratch, self.device = max_batch, scratch, device
        self.state = torch.zeros(2, scratch + 1, dtype=torch.int64, device=device)  # [LAST/START, slots + 1]
        # each slot's sampling parameters, as its prefill wrote them; the scratch slot's stay greedy
        self.params = torch.zeros(2, scratch + 1, dtype=torch.int64, device=device)  # [SEED/TOP_K, slots + 1]
        self.params[TOP_K - SEED] = -1
        self.fparams = torch.zeros(3, scratch + 1, dtype=torch.float32, device=device)  # [TEMPERATURE/TOP_P/INV_TEMP, slots + 1]
        self.fparams[TOP_P] = 1.0
        self.meta = torch.zeros(6, max_batch, dtype=torch.int64, device=device)  # [field, max_batch]
        self.fmeta = torch.zeros(3, max_batch, dtype=torch.float32, device=device)  # [field, max_batch]
        self.meta[TOP_K], self.fmeta[TOP_P] = -1, 1.0  # greedy until the first gather
        self.drafts = torch.zeros(max_batch, max(1, num_drafts), dtype=torch.int64, device=device)  # [max_batch, K]
        # the head readouts' state between launches (one stream): with the invariant kernels a verify's
        # draws fold into it at any batch (the plain kernels' head folds up to MAX_ROWS rows)
        self.argmax = argmax if argmax is not None else ArgmaxScratch(device, max(MAX_ROWS, max_batch * (num_drafts + 1)))
        pinned = device.type == "cuda"
        self._host = [torch.zeros(2, max_batch, dtype=torch.int64, pin_memory=pinned) for _ in range(STAGING)]  # SLOT, DRAFT_SLOT
        self._copied = [torch.cuda.Event() if pinned else None for _ in range(STAGING)]  # staging i reusable once set
        self._index = events.device_index(device) if pinned else -1
        self._turn = 0
        self._key: tuple | None = None
        self._slots = self.meta[SLOT : DRAFT_SLOT + 1]  # [2, max_batch]: what a load copies in
        self.load([], max_batch)

    def load(self, reqs: list[Request | None], bucket: int) -> None:
        """Copy the rows' slots in (one small asynchronous copy); rows past len(reqs), and None
        rows, are padding. A load of the rows already loaded is skipped."""
        key = (tuple(r.rid if r is not None else None for r in reqs), bucket)
        if key == self._key:
            return
        pad = [self.scratch] * (bucket - len(reqs))
        i, self._turn = self._turn, (self._turn + 1) % STAGING
        host, copied = self._host[i], self._copied[i]
        if copied is not None:
            copied.synchronize()  # that staging's last copy has read it (STAGING loads ago)
        host.numpy()[:, :bucket] = ([self.scratch if r is None else r.kv for r in reqs] + pad,
                                    [draft_slot(None if r is None else r.draft_state, self.scratch) for r in reqs] + pad)
        # every column: a bucket's graphs read its first ``bucket`` (no slices made on the host)
        self._slots.copy_(host, non_blocking=copied is not None)
        if copied is not None:
            events.record(copied, self._index)
        self._key = key

    def forget(self) -> None:
        """The next load copies its rows in even if their ids are those loaded last."""
        self._key = None

    def gather(self, bucket: int) -> None:
        """meta's LAST, START and sampling rows, and fmeta, from each row's slot: what a graph
        opens with."""
        _gather_kernel[(bucket,)](self.meta, self.fmeta, self.state, self.params, self.fparams, self.meta.stride(0),
                                  self.fmeta.stride(0), self.state.stride(0), self.params.stride(0),
                                  self.fparams.stride(0), LAST_ROW=LAST, START_ROW=START, SLOT_ROW=SLOT,
                                  SEED_ROW=SEED, FLOATS=3)

    def remember(self, slots: Tensor, params: Tensor, fparams: Tensor) -> None:
        """The sampling parameters of the requests prefilled in ``slots`` [n]: params [2, n]
        (seed, top-k), fparams [3, n] (temperature, top-p, inverse temperature); padding rows
        (the scratch slot) write the scratch slot's own greedy defaults."""
        self.params[:, slots] = params
        self.fparams[:, slots] = fparams

    def place(self, slots: Tensor, last: Tensor, start: Tensor, where: Tensor | None = None) -> None:
        """A prefilled request's state: its first token, at the position after its prompt (only
        rows ``where`` is true, when given: the others write back what their slot holds)."""
        if where is not None:
            last, start = torch.where(where, last, self.state[0, slots]), torch.where(where, start, self.state[1, slots])
        self.state[0, slots] = last
        self.state[1, slots] = start

    def row(self, field: int, bucket: int) -> Tensor:
        return self.meta[field, :bucket]

    def sampling(self, bucket: int) -> SamplingBatch:
        return SamplingBatch(temperature=self.fmeta[TEMPERATURE, :bucket], top_k=self.meta[TOP_K, :bucket],
                             top_p=self.fmeta[TOP_P, :bucket], seed=self.meta[SEED, :bucket])


def inverse_temperature(temperature: Tensor) -> Tensor:
    """1 / temperature, 0 for greedy rows: what the sampling kernels scale raw logits by."""
    return torch.where(temperature > 0, 1.0 / temperature.clamp(min=1e-6), torch.zeros_like(temperature))


def host_inverse_temperature(temperature: np.ndarray) -> np.ndarray:
    """inverse_temperature of host float32 values, bit for bit (float32 throughout): a round's
    row load computes it on the host, where numpy's small-array ops cost a fraction of PyTorch's."""
    return np.where(temperature > 0, np.float32(1) / np.maximum(temperature, np.float32(1e-6)), np.float32(0))


def draft_slot(state, scratch: int) -> int:
    """A request's drafter cache slot (its draft_state's index), or the scratch slot."""
    index = getattr(state, "index", -1)
    return index if index >= 0 else scratch


@triton.jit
def _ring_write_kernel(data, slots, start, feats, depth, F, s_slot, s_row, s_n, s_w, BLOCK: tl.constexpr):
    """Program (n, w): row n's features at window position w into ring row (start + w) mod depth."""
    n, w = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    row = ((tl.load(start + n) + w) % depth + depth) % depth  # floor mod, as torch's %
    base = data + tl.load(slots + n).to(tl.int64) * s_slot + row * s_row
    for f0 in range(0, F, BLOCK):
        f = f0 + tl.arange(0, BLOCK)
        x = tl.load(feats + n * s_n + w * s_w + f, mask=f < F)
        tl.store(base + f, x, mask=f < F)


@triton.jit
def _ring_read_kernel(data, slots, start, out, shift, depth, F, s_slot, s_row, BLOCK: tl.constexpr):
    """Program n: out[n] = the ring row of position start + shift (floor mod depth)."""
    n = tl.program_id(0).to(tl.int64)
    row = ((tl.load(start + n) + shift) % depth + depth) % depth
    base = data + tl.load(slots + n).to(tl.int64) * s_slot + row * s_row
    for f0 in range(0, F, BLOCK):
        f = f0 + tl.arange(0, BLOCK)
        tl.store(out + n * F + f, tl.load(base + f, mask=f < F), mask=f < F)


class FeatureRing:
    """Each request's tapped target features at its last verified positions, for drafters
    that read them (Drafter.reads_last_features): [slots + 1, depth, F], a position p of a
    request at row p % depth of its slot. The verify graph writes its W positions; the next
    draft step reads start - 1, one of them. depth > 2W keeps that entry intact when the two
    rounds launched ahead (which write up to 2W positions past it) are dropped and the round
    runs again. A write and a read are one kernel each: as indexing they took an arange, an
    add and a remainder besides the index, and a chain round does both (three times)."""

    BLOCK = 1024  # features a program moves per step of its loop

    def __init__(self, num_slots: int, depth: int, width: int, dtype: torch.dtype, device: torch.device):
        self.depth = depth
        self.data = torch.zeros(num_slots + 1, depth, width, dtype=dtype, device=device)  # [slots + 1, depth, F]

    def write(self, slots: Tensor, start: Tensor, features: Tensor) -> None:
        """features [N, W, F] of positions start .. start + W - 1 of each row's slot."""
        n, w, f = features.shape
        if f != self.data.shape[2] or slots.shape != (n,) or start.shape != (n,):
            raise ValueError(f"FeatureRing.write: features {tuple(features.shape)} for {tuple(slots.shape)} slots and "
                             f"{tuple(start.shape)} starts; the ring holds {self.data.shape[2]} features a position")
        if features.dtype != self.data.dtype:  # rounded as torch rounds (the interpreter's cast truncates)
            features = features.to(self.data.dtype)
        if features.stride(-1) != 1:
            features = features.contiguous()
        if n and w:
            _ring_write_kernel[(n, w)](self.data, slots.contiguous(), start.contiguous(), features, self.depth, f,
                                       self.data.stride(0), self.data.stride(1), features.stride(0),
                                       features.stride(1), BLOCK=min(self.BLOCK, triton.next_power_of_2(f)))

    def read(self, slots: Tensor, start: Tensor, shift: int = 0) -> Tensor:
        """-> [N, F] at each row's position ``start + shift`` (padding rows at -1 read a harmless row)."""
        n, f = slots.shape[0], self.data.shape[2]
        out = torch.empty(n, f, dtype=self.data.dtype, device=self.data.device)
        if n:
            _ring_read_kernel[(n,)](self.data, slots.contiguous(), start.contiguous(), out, shift, self.depth, f,
                                    self.data.stride(0), self.data.stride(1),
                                    BLOCK=min(self.BLOCK, triton.next_power_of_2(f)))
        return out
