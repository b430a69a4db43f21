"""Where launched rounds' (and prefills') results come back to the host: one small asynchronous
copy a launch into a pinned buffer kept for its width, and the events that time its device work.
``collect`` waits for that copy alone, so rounds launched after it keep the device busy."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from draftline.core.contract import RoundResult

from . import events
from . import logprobs as target_logprobs


@dataclass(frozen=True)
class Launch:
    """A launched round: where its packed result lands on the host, and when it has."""

    rows: int
    width: int
    host: Tensor  # [>= rows, 2W + 1] int64: finite, accepted, tokens (W), drafts (W - 1)
    copied: torch.cuda.Event | None  # None: the copy was synchronous
    logprobs: tuple[target_logprobs.Pending, ...] = ()  # on their way to the host with the result
    started: torch.cuda.Event | None = None  # recorded before the round's first device work (timing)
    kept: bool = False  # its events are in the backend's timeline (not reused once collected)


class Landing:
    def __init__(self, device: torch.device, max_batch: int):
        self.device, self.max_batch = device, max_batch
        self.device_index = events.device_index(device) if device.type == "cuda" else -1  # events.record's
        self._free: dict[int, list[Tensor]] = {}  # width -> pinned result buffers not in use
        self._events: list[torch.cuda.Event] = []  # timing events collected rounds are done with (a new one costs the host)
        self.timeline: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None  # set: launches' GPU spans
        self._origin: torch.cuda.Event | None = None  # the device clock's zero for RoundResult.device_at: start-up's end

    def mark_origin(self) -> None:
        """RoundResult.device_at counts from here (the end of start-up)."""
        self._origin = torch.cuda.Event(enable_timing=True)
        events.record(self._origin, self.device_index)

    def started(self) -> torch.cuda.Event | None:
        """An event at the start of a launch's device work: with the one after its copy back, the
        round's own device time, which the draft policy prices widths by (the wall clock between
        collects also reads the host's hiccups, and a rarely run width has few rounds to
        outvote them) and ``timeline`` keeps for draftline bench."""
        if self.device.type != "cuda":
            return None
        started = self._timing_event()
        events.record(started, self.device_index)
        return started

    def _timing_event(self) -> torch.cuda.Event:
        """A timing event a collected round is done with, or a new one."""
        return self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)

    def land(self, packed: Tensor, width: int, logprobs: list | None = None,
             started: torch.cuda.Event | None = None, span: bool = True) -> Launch:
        """The launch's one copy back: into a free pinned buffer, asynchronously (and the
        logprobs of rows that report them, beside it). ``started``: the launch's first event,
        timing its device work; ``span``: a round's, which ``timeline`` keeps (not a prefill's)."""
        moved = tuple(p.to_host() for p in logprobs or ())
        if self.device.type != "cuda":
            return Launch(packed.shape[0], width, packed.cpu(), None, moved)
        free = self._free.setdefault(width, [])
        host = free.pop() if free else torch.empty(self.max_batch, 2 * width + 1, dtype=torch.int64, pin_memory=True)
        host[: packed.shape[0]].copy_(packed, non_blocking=True)
        copied = self._timing_event() if started is not None else torch.cuda.Event()
        events.record(copied, self.device_index)
        kept = self.timeline is not None and started is not None and span
        if kept:
            self.timeline.append((started, copied))
        return Launch(packed.shape[0], width, host, copied, moved, started, kept)

    def collect(self, handle: Launch) -> RoundResult:
        """Wait for a launch's copy and read what its device decided."""
        if handle.copied is not None:
            handle.copied.synchronize()
        rows, w = handle.host[: handle.rows].tolist(), handle.width
        if handle.copied is not None:
            self._free[w].append(handle.host)
        for pending in handle.logprobs:
            pending.record([r[1] for r in rows])
        timed = handle.started is not None
        device_s = handle.started.elapsed_time(handle.copied) / 1e3 if timed else None
        device_at = self._origin.elapsed_time(handle.started) / 1e3 if timed and self._origin is not None else None
        if timed and not handle.kept:
            self._events += (handle.started, handle.copied)
        return RoundResult(finite=[r[0] == 1 for r in rows], accepted=[r[1] for r in rows],
                           tokens=[r[2 : 3 + r[1]] for r in rows], drafted=[r[2 + w : 1 + 2 * w] for r in rows],
                           device_s=device_s, device_at=device_at)
