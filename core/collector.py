"""Python's cyclic collector while serving.

A full collection walks every object the collector tracks, and start-up leaves a few hundred
thousand of them (modules, the model and its kernels, the server). Each full collection stalls
the engine thread and every stream with it, which a request's inter-token gaps and a step's
host time show as spikes, and its length grows with what it walks. The loop therefore freezes
what start-up made, as vLLM's engine core does, so collections walk only what serving made
since, and logs each full collection that still takes longer than ``long_s``. Frozen
objects are never collected, so stopping the loop unfreezes them (tests start many servers in
one process)."""

from __future__ import annotations

import gc
import time
from typing import Any

import structlog

log = structlog.get_logger("draftline.loop")

LONG_S = 0.02  # a full collection past this is logged (about a round of 8B decoding)


class Collector:
    def __init__(self, long_s: float = LONG_S):
        self.long_s = long_s
        self.full = 0  # full collections seen since start()
        self.longest_s = 0.0
        self._began: float | None = None

    def start(self) -> int:
        """Collect once, freeze what is left, watch full collections -> the objects frozen."""
        gc.collect()
        gc.freeze()
        gc.callbacks.append(self._observe)
        return gc.get_freeze_count()

    def stop(self) -> None:
        if self._observe in gc.callbacks:
            gc.callbacks.remove(self._observe)
        gc.unfreeze()

    def _observe(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._began = time.perf_counter()
            return
        if self._began is None:
            return
        took, self._began = time.perf_counter() - self._began, None
        self.full += 1
        self.longest_s = max(self.longest_s, took)
        if took > self.long_s:
            log.warning("gc.pause", ms=round(1e3 * took, 1), collected=info.get("collected"),
                        hint="objects that serving keeps (requests, prefix blocks) make full collections longer")

    def summary(self) -> dict[str, Any]:
        """What /health shows."""
        return {"frozen_objects": gc.get_freeze_count(), "full_collections": self.full,
                "longest_full_ms": round(1e3 * self.longest_s, 1)}
