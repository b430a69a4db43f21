"""CUDA events recorded on the engine thread's current stream, its device named by index.

``Event.record()`` with no stream looks the current device up through PyTorch's availability
checks (the driver's, and environment variables) before it records: on the H200 that lookup
was most of the host time of a record, and a round records four events (its start, its copy
back, the step buffers' and the staging slab's copies). Naming the device by index skips it."""

from __future__ import annotations

import torch


def device_index(device: torch.device) -> int:
    """The CUDA device's index (the current device for a plain ``cuda``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def record(event: torch.cuda.Event, index: int) -> None:
    """``event`` on the current stream of device ``index`` (what ``event.record()`` records on)."""
    event.record(torch.cuda.current_stream(index))
