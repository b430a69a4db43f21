"""Prefills beside the rounds (off unless ``DRAFTLINE_PREFILL_BESIDE=1``): on a model whose
kernels are bound by their launches (the tiny pair's), a prefill and a round each leave most of
the GPU idle, yet in one stream a newly admitted prompt's prefill stalls every running row for
its whole length (about a round's time a readmission). Here a prefill runs on a stream of its
own, concurrently with the rounds launched after it, and its rows join from the next step:
their first round waits for it.

Ordering: the prefill stream first waits for everything already on the rounds' stream (a
finished request's rounds in flight still write the slot a new prompt takes, and a prefix hit
reads blocks a round's stream may hold in order), and the prefills follow one another on it
(a prefix block saved by one is restored by a later one). Rounds launched after the prefill
touch only their own rows' slots and the scratch slot (padding), never the prefilling rows',
so only the rounds that carry a prefilled row wait, on the last prefill's event, which covers
every earlier one. Prefills count attention's arrivals in tickets of their own
(StaticKV.prefills_apart), and their graphs keep a memory pool of their own.

Why off: on the H200 with the shipped tiny pair at 16 slots, a round ran longer while a
prefill ran beside it, the rows joining a step later made rounds thinner, and the passes were
no faster than in line within the hosts' spread (docs/RESULTS.md; ``DRAFTLINE_PREFILL_BESIDE=1``
against the default measures it).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch

from draftline.core.request import Request

from . import events


def beside_wanted(device: torch.device, graphs: bool) -> bool:
    """Prefills go beside the rounds: asked for (``DRAFTLINE_PREFILL_BESIDE=1``), on a GPU with graphs."""
    return device.type == "cuda" and graphs and os.environ.get("DRAFTLINE_PREFILL_BESIDE") == "1"


class PrefillStream:
    """The prefills' own stream, and the rows whose first round must wait for their prefill."""

    def __init__(self, device: torch.device, on: bool):
        self.stream = torch.cuda.Stream(device) if on else None
        self.index = events.device_index(device) if on else -1
        self.done = torch.cuda.Event() if on else None  # recorded after each prefill on the stream
        self.pending: set[int] = set()  # slots prefilled beside, not yet in a round that waited for them
        self.active = False  # start-up's prefills stay in line (their captures and timings read one stream)

    @property
    def on(self) -> bool:
        return self.stream is not None and self.active

    @contextmanager
    def run(self, reqs: list[Request]) -> Iterator[None]:
        """Run the block (a prefill of ``reqs``) on the prefill stream after everything already
        on the current one; its rows' first round waits for it (``join``)."""
        self.stream.wait_stream(torch.cuda.current_stream(self.index))
        with torch.cuda.stream(self.stream):
            yield
            self.done.record(self.stream)
        self.pending.update(r.kv for r in reqs)

    def join(self, reqs: list[Request]) -> None:
        """Before a round over ``reqs``: wait for the prefills of any of them still pending."""
        if self.pending and any(r.kv in self.pending for r in reqs):
            self.join_all()  # the last prefill's event covers every one before it

    def join_all(self) -> None:
        """The current stream waits for every prefill run beside so far."""
        torch.cuda.current_stream(self.index).wait_event(self.done)
        self.pending.clear()

    def forget(self, slot: int | None) -> None:
        self.pending.discard(slot)
