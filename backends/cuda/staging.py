"""Small host values onto the device in stream order, without waiting and without pinning anew.

The backend moves a few host values a step (page-table entries, a prefill's rows, prefix
pages). A pageable copy waits for every launch in flight, which would drain the pipeline, and
pinning a new buffer each time took 1.0 s of the engine thread's 16.8 busy seconds at 256
serving streams on an H200 (py-spy). So the values pass through a few pinned slabs kept for good: a slab
is written again once the device has read it (its event), and a value too large for a slab,
or a step with every slab still in flight, falls back to pinning its own buffer. Several
values put together share one slab and one copy (a prefill's rows and its columns), and
values built with numpy are written into the slab as they are: each torch call on the host
costs several microseconds, a nested list made a tensor tens."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from . import events

SLAB_BYTES = 1 << 18  # a page table's new entries at 256 rows, or a prefill's rows, fit
SLABS = 16  # several copies a step, two rounds in flight: a slab is free again long before its turn


_TORCH = {np.dtype(t): torch.from_numpy(np.zeros(0, t)).dtype
          for t in (np.int64, np.int32, np.int16, np.int8, np.uint8, np.float64, np.float32, np.float16, np.bool_)}


class Staging:
    def __init__(self, device: torch.device, slab_bytes: int = SLAB_BYTES, slabs: int = SLABS):
        self.device, self.slab_bytes = device, slab_bytes
        pinned = device.type == "cuda"
        self.slabs = [torch.empty(slab_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(slabs)] if pinned else []
        self.read = [torch.cuda.Event() for _ in self.slabs]  # set once the device has copied slab i
        self.index = events.device_index(device) if pinned else -1
        self.used = [False] * len(self.slabs)
        self.turn = 0
        self.fallbacks = 0  # puts that pinned a buffer of their own (tests and benches read it)

    def put(self, host: Tensor | np.ndarray) -> Tensor:
        """``host`` (a CPU tensor or a numpy array) on the device, in the current stream's order,
        without a wait."""
        return self.put_many(host)[0]

    def put_many(self, *values: Tensor | np.ndarray) -> tuple[Tensor, ...]:
        """Each of ``values`` (host values numpy can hold: integers, floats, bools; not bfloat16)
        on the device, all in one copy from one slab (each 8-byte aligned)."""
        arrays = [v if isinstance(v, np.ndarray) else v.contiguous().numpy() for v in values]
        if not self.slabs:
            return tuple(torch.from_numpy(np.ascontiguousarray(a)).to(self.device) for a in arrays)
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // 8) * 8
        i, slab = self._slab(total)
        host = slab.numpy()
        for a, at in zip(arrays, offsets):
            host[at : at + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
        moved = slab[:total].to(self.device, non_blocking=True)
        self._sent(i)
        return tuple(moved[at : at + a.nbytes].view(_TORCH[a.dtype]).view(a.shape) for a, at in zip(arrays, offsets))

    def put_into(self, dest: Tensor, host: np.ndarray) -> None:
        """``host`` (a flat numpy array of ``dest``'s element size) into dest[: host.size] on
        the device, in stream order, without a wait: one copy from a slab, straight into a
        buffer a captured graph reads (no device tensor made, no copy on the device)."""
        if dest.dim() != 1 or host.ndim != 1 or host.itemsize != dest.element_size() or host.size > dest.shape[0]:
            raise ValueError(f"put_into: {host.size} x {host.dtype} into {tuple(dest.shape)} {dest.dtype}")
        if not self.slabs:
            dest[: host.size].copy_(torch.from_numpy(host).view(dest.dtype))
            return
        i, slab = self._slab(host.nbytes)
        slab.numpy()[: host.nbytes] = host.view(np.uint8)
        dest[: host.size].view(torch.uint8).copy_(slab[: host.nbytes], non_blocking=True)
        self._sent(i)

    def _slab(self, nbytes: int) -> tuple[int | None, Tensor]:
        """(index, slab) of a free slab for ``nbytes``, or (None, a buffer pinned for them alone)."""
        i = self._free() if 0 < nbytes <= self.slab_bytes else None
        if i is None:
            self.fallbacks += 1
            return None, torch.empty(max(nbytes, 8), dtype=torch.uint8, pin_memory=True)
        return i, self.slabs[i]

    def _sent(self, i: int | None) -> None:
        """Slab ``i``'s copy is enqueued: it is written again once the device has read it."""
        if i is not None:
            events.record(self.read[i], self.index)
            self.used[i] = True

    def _free(self) -> int | None:
        """The next slab the device is done with, in turn; None when all are in flight."""
        for _ in range(len(self.slabs)):
            i, self.turn = self.turn, (self.turn + 1) % len(self.slabs)
            if not self.used[i] or self.read[i].query():
                return i
        return None
