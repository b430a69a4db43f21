"""Simulated acceptance for `draftline bench --acceptance`: drafts that are accepted at a
chosen rate, on weights whose own drafts never are (random 8B-shaped weights).

The drafter runs its full forward as usual; then, inside the captured draft step, its tokens
are replaced by each row's own greedy continuation (from a `none` run over the same prompts
first, then settled to what the method's own verify computes: draftline.core.benchmark's calibration
passes), made wrong at one position per round, drawn per prompt and position. Position j
of a round is accepted, given the ones before it were, with probability ``p``, so a round of
K drafts accepts min(G, K) of them, G geometric: tau = sum_{j<=K} p^j.
Verify, acceptance, KV writes, pipelining and stops are the real path. A benchmark, not a
method: its numbers are labelled simulated wherever they appear.
"""

from __future__ import annotations

import random
import zlib

import torch
from torch import Tensor

from .sampling import row_key, uniform

PROFILES = {"random": None, "dflash-paper": 0.86, "chain-paper": 0.70}  # DFlash's and EAGLE-3's Qwen3-8B figures
WRONG_STREAM = 7  # a random stream of its own: which draft of a round is made wrong


def profile_rate(profile: str) -> float | None:
    """'random' (no override: the drafter's own drafts), a named profile, or a rate in (0, 1]."""
    if profile in PROFILES:
        return PROFILES[profile]
    try:
        rate = float(profile)
    except ValueError:
        rate = -1.0
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"--acceptance {profile!r}: give one of {', '.join(PROFILES)} or a rate in (0, 1]")
    return rate


def accepted_runs(rng: random.Random, rows: int, width: int, rate: float) -> list[int]:
    """The profile's rounds drawn on the host, for stand-in devices and the policy's tests: each
    row's accepted drafts of width - 1, each accepted with ``rate`` given the one before."""
    out = []
    for _ in range(rows):
        a = 0
        while a < width - 1 and rng.random() < rate:
            a += 1
        out.append(a)
    return out


def expected_tau(rate: float | None, k: int) -> float:
    """Tokens per round under the profile: 1 + sum_{j=1..K} rate^j (1 for 'random')."""
    return 1.0 if rate is None else 1.0 + sum(rate**j for j in range(1, k + 1))


class SimulatedAcceptance:
    """A backend's draft override (cuda backend ``set_draft_override``): ``admit`` writes a
    prefilled request's prompt and greedy continuation at its KV slot; calling it rewrites a
    draft step's drafts [N, K] from that table, graph-safe (device tensors, keyed randomness)."""

    def __init__(self, rate: float, continuations: dict[tuple[int, ...], list[int]], num_slots: int, max_len: int,
                 vocab: int, device: torch.device):
        self.vocab, self.continuations = vocab, continuations
        self.rate = torch.tensor(rate, device=device)  # a tensor, so captured graphs read a new rate (set_rate)
        self.table = torch.zeros(num_slots + 1, max_len, dtype=torch.int64, device=device)  # [slots + 1, max_len]
        # [slots + 1] each slot's prompt key: the wrong draft's draw follows the prompt, not the
        # slot it landed in, so every run over a prompt makes the same rounds
        self.keys = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)

    def set_rate(self, rate: float) -> None:
        self.rate.fill_(rate)

    def admit(self, slot: int, prompt_ids: list[int]) -> None:
        known = self.continuations.get(tuple(prompt_ids))
        if known is None:
            raise KeyError("simulated acceptance: a prompt without a greedy continuation from the `none` run")
        row = torch.tensor((list(prompt_ids) + known)[: self.table.shape[1]])
        # in stream order, without waiting: a plain copy from pageable memory waits for every round
        # in flight, and admissions come while rounds run (the prefill's host step drained the pipeline)
        if self.table.is_cuda:
            row = row.pin_memory()
        self.table[slot, : len(row)].copy_(row, non_blocking=True)
        self.keys[slot].fill_(zlib.crc32(repr(list(prompt_ids)).encode()))

    def __call__(self, slots: Tensor, start: Tensor, drafts: Tensor) -> None:
        n, k = drafts.shape
        offsets = torch.arange(1, k + 1, device=drafts.device)
        positions = (start[:, None] + offsets).clamp(max=self.table.shape[1] - 1)  # [N, K] each draft's position
        truth = self.table[slots[:, None], positions]  # [N, K]
        u = uniform(row_key(self.keys[slots], start, WRONG_STREAM), k)  # [N, K]
        wrong = u >= self.rate
        first = torch.where(wrong.any(dim=1), wrong.int().argmax(dim=1), k)  # [N] the round's wrong draft (K: none)
        corrupt = offsets[None, :] - 1 == first[:, None]
        drafts.copy_(torch.where(corrupt, (truth + 1) % self.vocab, truth))
