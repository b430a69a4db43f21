"""Small host values onto the device in stream order, without waiting and without pinning anew.

The backend moves a few host values a step (page-table entries, a prefill's rows, prefix
pages). A pageable copy waits for every launch in flight, which would drain the pipeline, and
pinning a new buffer each time took 1.0 s of the engine thread's 16.8 busy seconds at 256
serving streams on an H200 (py-spy). So the values pass through a few pinned slabs kept for good: a slab
is written again once the device has read it (its event), and a value too large for a slab,
or a step with every slab still in flight, falls back to pinning its own buffer."""

from __future__ import annotations

import torch
from torch import Tensor

from . import events

SLAB_BYTES = 1 << 18  # a page table's new entries at 256 rows, or a prefill's rows, fit
SLABS = 16  # several copies a step, two rounds in flight: a slab is free again long before its turn


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

    def put(self, host: Tensor) -> Tensor:
        """``host`` (a CPU tensor) on the device, in the current stream's order, without a wait."""
        if not self.slabs:
            return host.to(self.device)
        host = host.contiguous()
        nbytes = host.numel() * host.element_size()
        i = self._free() if 0 < nbytes <= self.slab_bytes else None
        if i is None:
            self.fallbacks += 1
            return host.pin_memory().to(self.device, non_blocking=True)
        staged = self.slabs[i][:nbytes].view(host.dtype).view(host.shape)
        staged.copy_(host)
        moved = staged.to(self.device, non_blocking=True)
        events.record(self.read[i], self.index)
        self.used[i] = True
        return moved

    def _free(self) -> int | None:
        """The next slab the device is done with, in turn; None when all are in flight."""
        for _ in range(len(self.slabs)):
            i, self.turn = self.turn, (self.turn + 1) % len(self.slabs)
            if not self.used[i] or self.read[i].query():
                return i
        return None
