"""The KV pool counted in blocks: what admission and preemption decide by.

A running request holds the blocks its tokens need plus a lookahead: the positions the rounds
in flight for it may write past its booked length (each a verify window, or a DFlash block).
A waiting request is admitted while the pool has the blocks of its whole prompt; when the
running requests' next rounds need more blocks than the pool has, the newest past their
prefill are preempted first (a prompt part-way through its chunks would lose them): their KV
is dropped and recomputed when they are admitted again, which the batch-invariant prefill
makes exact.
The backend's store is what the pool stands for (the reference backend's caches grow with a
request; the cuda backend's target KV is then a pool of as many pages, taken as rows grow);
the count is what keeps their sum within ``server.num_kv_blocks``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .request import Request


@dataclass(frozen=True)
class BlockPool:
    size: int  # tokens a block (server.block_size)
    total: int  # blocks in the pool
    lookahead: int  # positions past a request's booked length that its rounds in flight may write

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.size)

    def demand(self, req: Request) -> int:
        """Blocks a running (or admitted) request holds: its whole prompt (or, resumed, what its
        prefill recomputes) and the first token drawn after it, or what it has generated, plus
        the lookahead."""
        return self.blocks(max(req.prefill_len + 1, req.seq_len) + self.lookahead)

    def most(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Blocks a request needs at its longest (a first token is drawn even for max_new_tokens 0)."""
        return self.blocks(prompt_tokens + max(max_new_tokens, 1) + self.lookahead)

    def victims(self, running: list[Request]) -> list[Request]:
        """The requests whose preemption lets the others' next rounds fit: the newest past their
        prefill first, then the newest part-way through it (the oldest always stays: a request
        that fits the pool alone is never preempted by itself)."""
        held = sum(self.demand(r) for r in running)
        if held <= self.total:  # the common case, every step: nothing to sort
            return []
        oldest = min(running, key=lambda r: r.rid, default=None)
        out = []
        for req in sorted((r for r in running if r is not oldest), key=lambda r: (r.prefilled >= r.prefill_len, r.rid),
                          reverse=True):
            if held <= self.total:
                break
            out.append(req)
            held -= self.demand(req)
        return out
