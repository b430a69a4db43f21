"""CUDA graphs keyed by (step, shape): captured on first use, replayed after.

A step function reads its inputs from persistent buffers and returns its outputs; the graph
keeps those output tensors, which every replay overwrites. All graphs share one memory pool
(and a second Graphs may share it: ``pool``): they never run concurrently, on one stream, and
each keeps its outputs referenced, so none reuses another's; one capture's temporaries are the
next one's. ``grown`` counts what the allocator reserved across captures (warm-ups included).
"""

from __future__ import annotations

import gc
import time
from typing import Any, Callable, Hashable

import structlog
import torch

from . import events

log = structlog.get_logger("draftline.cuda")


class Graphs:
    def __init__(self, enabled: bool, warmup: int = 2, pool: "Graphs | None" = None):
        self.enabled, self.warmup = enabled, warmup
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self._pool = (pool._pool if pool is not None else torch.cuda.graph_pool_handle()) if enabled else None
        # One stream for every capture's warm-up runs: the allocator keeps a freed block for its
        # stream, so a new stream a capture (torch hands out 32 in turn) kept up to 32 captures'
        # temporaries reserved apart.
        self._side = (pool._side if pool is not None else torch.cuda.Stream()) if enabled else None
        self.grown = 0  # bytes the allocator's reservation grew across this object's captures
        self.sealed = False  # start-up is over: a capture now runs on a request's path

    def seal(self) -> None:
        """Start-up captured what the spec can replay; a later capture is logged as a warning."""
        self.sealed = True

    def __len__(self) -> int:
        return len(self._graphs)

    def keys(self) -> list[Hashable]:
        return list(self._graphs)

    def replay_ms(self, key: Hashable, device_index: int) -> float:
        """One replay of ``key``'s graph, timed on the device (ms); it waits for the replay's end."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        events.record(start, device_index)
        self._graphs[key][0].replay()
        events.record(end, device_index)
        end.synchronize()
        return start.elapsed_time(end)

    def run(self, key: Hashable, step: Callable[[], Any]) -> Any:
        """Replay the graph for ``key``, capturing ``step`` first if needed; eager when disabled.
        Steps must be idempotent for the same buffers: warm-up runs execute them for real."""
        if not self.enabled:
            return step()
        if key not in self._graphs:
            begin = time.perf_counter()
            self._graphs[key] = self._capture(step)
            if self.sealed:  # a request waited for it: start-up should have captured this key
                log.warning("graph captured on the request path", key=repr(key),
                            ms=round(1e3 * (time.perf_counter() - begin), 1))
        graph, out = self._graphs[key]
        graph.replay()
        return out

    def _capture(self, step: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        before = torch.cuda.memory_reserved()
        side = self._side
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile kernels and settle the allocator outside capture
            for _ in range(self.warmup):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        collecting = gc.isenabled()
        gc.disable()  # a collection inside the capture may destroy an unreachable engine's graph, which
        try:  # CUDA refuses while a stream captures: it invalidates this capture
            with torch.cuda.graph(graph, pool=self._pool):
                out = step()
        finally:
            if collecting:
                gc.enable()
        self.grown += torch.cuda.memory_reserved() - before
        return graph, out
