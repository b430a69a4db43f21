"""Programmatic dependent launch (Hopper and later): a kernel may be launched while the one
before it in the stream still runs, so the ~300 launches of a decode step stop paying a
launch and a ramp-up each.

The decoder-layer kernels (matvec, norms, q/k/v, attention and its combine, KV store, SiLU·up;
the sampling kernels at a round's end launch plainly) are launched with ``launch_pdl`` and
begin with ``gate``: each waits there until the kernels before it have finished and their
writes are visible (the hardware's grid dependency wait, so correctness never rests on where
a kernel lets the next one launch). Kernels whose successor gains from launching early then
release it at once: the matvecs, the norms and the q/k/v kernel. Attention and its combine do
not: on an H200 a combine launched beside attention's splits, or an output matvec beside the
combine, made the DFlash round slower. The one read before a gate
is attention's L2 prefetch of its split's cached keys: it trusts nothing it read there.

Off in the Triton interpreter (no such hardware) and before Hopper; ``DRAFTLINE_PDL=0``
turns it off for comparison.

Work that nothing after it in a step reads (the DFlash drafter's context update in the verify
step) goes on a ``Branch``: a side stream forked from the step's stream and joined at its end,
so a captured graph runs it beside the LM head instead of before it.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from typing import Iterator

import torch
import triton
import triton.language as tl

OFF, WAIT, RELEASE = 0, 1, 2  # gate modes


@functools.cache
def enabled() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("DRAFTLINE_PDL", "1") == "0":
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def launch(release: bool) -> dict:
    """The launch keywords of a gated kernel: its gate mode (OFF without PDL, else WAIT, or
    RELEASE to let the next kernel launch early) and whether to launch it with PDL."""
    if not enabled():
        return {"PDL": OFF, "launch_pdl": False}
    return {"PDL": RELEASE if release else WAIT, "launch_pdl": True}


@triton.jit
def gate(MODE: tl.constexpr):
    """WAIT: block until the kernels ahead in the stream are done and their writes visible.
    RELEASE: then let the next kernel launch (it still waits at its own gate). Every program
    must pass here before it reads or writes anything a kernel ahead touches."""
    if MODE >= 1:
        tl.extra.cuda.gdc_wait()
    if MODE == 2:
        tl.extra.cuda.gdc_launch_dependents()


class Branch:
    """A side stream for work the rest of a step does not read: ``fork()`` runs its block there
    (after everything already on the step's stream), ``join()`` makes the step's stream wait
    for it. High priority, so its small launches take multiprocessors as the long kernel beside
    them frees them. Off a GPU the block runs in line and ``join`` does nothing."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        self._forked = False  # a join without a fork would tie a graph capture to work outside it

    @contextmanager
    def fork(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        self._forked = True
        with torch.cuda.stream(self.stream):
            yield

    def join(self) -> None:
        """Make the current stream wait for what ``fork`` ran since the last join, if anything."""
        if self._forked:
            torch.cuda.current_stream().wait_stream(self.stream)
            self._forked = False
