"""The one owner of the cuda backend's persistent per-row device buffers.

Graphs read their inputs from these tensors, so a replay sees whatever was last loaded. The
padding rows of a bucket point at the caches' scratch slot and at position 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from core.request import Request
from core.sampling import SamplingBatch

from .matvec import ArgmaxScratch

# rows of Buffers.meta (int64) and Buffers.fmeta (float32); LAST and START are adjacent (step_on copies both)
LAST, START, SLOT, DRAFT_SLOT, SEED, TOP_K = range(6)
TEMPERATURE, TOP_P, INV_TEMP = range(3)


class Buffers:
    def __init__(self, max_batch: int, num_drafts: int, scratch: int, device: torch.device):
        self.max_batch, self.scratch, self.device = max_batch, scratch, device
        self.meta = torch.zeros(6, max_batch, dtype=torch.int64, device=device)  # [field, max_batch]
        self.fmeta = torch.zeros(3, max_batch, dtype=torch.float32, device=device)  # [field, max_batch]
        self.drafts = torch.zeros(max_batch, max(1, num_drafts), dtype=torch.int64, device=device)  # [max_batch, K]
        self.next = torch.zeros(2, max_batch, dtype=torch.int64, device=device)  # [LAST/START, max_batch] after the round
        self.argmax = ArgmaxScratch(device)  # the greedy head readouts' state between launches (one stream)
        pinned = device.type == "cuda"
        self._host_i = torch.zeros(6, max_batch, dtype=torch.int64, pin_memory=pinned)  # staging, reused
        self._host_f = torch.zeros(3, max_batch, dtype=torch.float32, pin_memory=pinned)
        self._copied = torch.cuda.Event() if pinned else None  # the staging may be rewritten once set
        self._key: tuple | None = None
        self.load([], max_batch)

    def load(self, reqs: list[Request], bucket: int) -> None:
        """Copy the rows' facts in (two small asynchronous copies); rows past len(reqs) are
        padding. A repeat load of the same rows at the same lengths is skipped."""
        key = (rows_key(reqs), bucket)
        if key == self._key:
            return
        pad = bucket - len(reqs)
        ints = [[r.last_token for r in reqs] + [0] * pad,
                [r.seq_len - 1 for r in reqs] + [0] * pad,
                [r.kv for r in reqs] + [self.scratch] * pad,
                [_slot(r.draft_state, self.scratch) for r in reqs] + [self.scratch] * pad,
                [r.params.seed for r in reqs] + [0] * pad,
                [r.params.top_k for r in reqs] + [-1] * pad]
        floats = [[r.params.temperature for r in reqs] + [0.0] * pad, [r.params.top_p for r in reqs] + [1.0] * pad]
        if self._copied is not None:
            self._copied.synchronize()  # the previous load's copies have read the staging
        self._host_i.numpy()[:, :bucket] = ints
        self._host_f.numpy()[: INV_TEMP, :bucket] = floats
        self._host_f[INV_TEMP, :bucket] = inverse_temperature(self._host_f[TEMPERATURE, :bucket])
        pinned = self._copied is not None
        self.meta[:, :bucket].copy_(self._host_i[:, :bucket], non_blocking=pinned)
        self.fmeta[:, :bucket].copy_(self._host_f[:, :bucket], non_blocking=pinned)
        if pinned:
            self._copied.record()
        self._key = key

    def step_on(self, bucket: int) -> None:
        """Take the rows' last token and start as the last verify graph left them in ``next``
        (graphs must stay idempotent, so they never move ``meta`` themselves); the next load
        then copies again."""
        self.meta[LAST : START + 1, :bucket].copy_(self.next[:, :bucket])
        self._key = None

    def row(self, field: int, bucket: int) -> Tensor:
        return self.meta[field, :bucket]

    def sampling(self, bucket: int) -> SamplingBatch:
        return SamplingBatch(temperature=self.fmeta[TEMPERATURE, :bucket], top_k=self.meta[TOP_K, :bucket],
                             top_p=self.fmeta[TOP_P, :bucket], seed=self.meta[SEED, :bucket])


def inverse_temperature(temperature: Tensor) -> Tensor:
    """1 / temperature, 0 for greedy rows: what the sampling kernels scale raw logits by."""
    return torch.where(temperature > 0, 1.0 / temperature.clamp(min=1e-6), torch.zeros_like(temperature))


def rows_key(reqs: list[Request]) -> tuple[tuple[int, int], ...]:
    """Which requests at which lengths: equal keys mean the same rows in the same round."""
    return tuple((r.rid, r.seq_len) for r in reqs)


def _slot(state, scratch: int) -> int:
    index = getattr(state, "index", -1)
    return index if index >= 0 else scratch


class FeatureRing:
    """Each request's tapped target features at its last verified positions, for drafters
    that read them (Drafter.reads_last_features): [slots + 1, depth, F], a position p of a
    request at row p % depth of its slot. The verify graph writes its W positions; the next
    draft step reads start - 1, one of them. depth > 2W keeps that entry intact when the two
    rounds launched ahead (which write up to 2W positions past it) are dropped and the round
    runs again."""

    def __init__(self, num_slots: int, depth: int, width: int, dtype: torch.dtype, device: torch.device):
        self.depth = depth
        self.data = torch.zeros(num_slots + 1, depth, width, dtype=dtype, device=device)  # [slots + 1, depth, F]

    def write(self, slots: Tensor, start: Tensor, features: Tensor) -> None:
        """features [N, W, F] of positions start .. start + W - 1 of each row's slot."""
        rows = (start[:, None] + torch.arange(features.shape[1], device=start.device)) % self.depth  # [N, W]
        self.data[slots[:, None], rows] = features.to(self.data.dtype)

    def read(self, slots: Tensor, position: Tensor) -> Tensor:
        """-> [N, F] at each row's ``position`` (padding rows at -1 read a harmless row)."""
        return self.data[slots, position % self.depth]
