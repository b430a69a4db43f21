"""A request's mutable state inside the engine, and its speculative-decoding statistics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .logprobs import TokenLogprob
from .sampling import SamplingParams


@dataclass(frozen=True)
class Round:
    """One draft -> verify -> accept round, for --trace."""

    position: int  # absolute position of the first drafted token
    drafted: tuple[int, ...]
    accepted: int
    emitted: tuple[int, ...]  # after stop truncation


@dataclass
class SpecStats:
    num_drafts: int  # K per round
    verify_ct: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    round_tokens: int = 0  # accepted + 1 per round, before stop truncation
    drafted_rounds: int = 0  # rounds that drafted (the policy may skip drafting under load)
    expected_accepted: float = 0.0  # what the draft policy's acceptance model expected its rounds to accept
    accepted_per_pos: list[int] = field(default_factory=list)  # [K]

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_drafts

    def record(self, accepted: int, drafted: int) -> None:
        self.verify_ct += 1
        self.draft_tokens += drafted
        self.drafted_rounds += drafted > 0
        self.accepted_tokens += accepted
        self.round_tokens += accepted + 1
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def accept_length(self) -> float:
        """τ: mean tokens emitted per verify round (the bonus/correction token included)."""
        return self.round_tokens / self.verify_ct if self.verify_ct else 0.0

    @property
    def accept_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def accept_per_pos(self) -> list[float]:
        return [a / self.drafted_rounds if self.drafted_rounds else 0.0 for a in self.accepted_per_pos]


@dataclass
class Request:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]  # EOS (unless ignored) plus the request's stop ids
    max_model_len: int
    stats: SpecStats
    output_ids: list[int] = field(default_factory=list)
    phase: Any = None  # machine.Phase
    finish_reason: dict[str, Any] | None = None
    kv: Any = None  # the backend's handle for this request's target KV
    draft_state: Any = None  # the drafter's per-request state
    rounds: list[Round] | None = None  # filled when tracing
    speculate: bool = True  # False: this request never drafts
    stop_strings: tuple[str, ...] = ()
    cancelled: bool = False  # set from another thread; the machine frees the slot next step
    cancel_reason: str = "cancelled"  # its finish reason's message once cancelled
    in_flight: int = 0  # rounds launched for it whose results the machine has not yet collected
    # absolute position -> the target's logprob of the token there (params.logprobs / prompt_logprobs)
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    t_arrival: float = field(default_factory=time.perf_counter)
    t_first_token: float | None = None
    t_finish: float | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prefilled: int = 0  # prompt tokens the backend has run (or taken from the cache): a chunked prefill's progress
    prefix_blocks: list[Any] = field(default_factory=list)  # the prefix cache's blocks it pins
    # preempted: its KV dropped, and its generated tokens so far prefilled again with the prompt
    recomputed: int = 0  # output tokens the prefill covers (0: never preempted)
    preemptions: int = 0
    grammar: Any = None  # core.grammar.Matcher while a constraint holds its tokens (None: unconstrained)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_ids(self) -> list[int]:
        """What the prefill runs: the prompt, and after a preemption the tokens generated before it."""
        return self.prompt_ids + self.output_ids[: self.recomputed] if self.recomputed else self.prompt_ids

    @property
    def prefill_len(self) -> int:
        return len(self.prompt_ids) + self.recomputed

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def cancel(self, reason: str = "cancelled") -> None:
        """End it at the next step (from any thread), with ``reason`` as its abort message."""
        self.cancel_reason, self.cancelled = reason, True

    def finish(self, reason: dict[str, Any]) -> None:
        self.finish_reason = reason
        self.t_finish = time.perf_counter()

    def append(self, tokens: list[int]) -> None:
        """Append tokens the machine decided to keep (draftline.core.stops)."""
        if tokens and self.t_first_token is None:
            self.t_first_token = time.perf_counter()
        self.output_ids.extend(tokens)
