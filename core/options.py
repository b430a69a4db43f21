"""The one user-facing sampling-parameters model.

The spec's ``sampling:`` section is a ``SamplingOptions``; every API maps its own field names
onto the same fields (with the same bounds, the ``Annotated`` types of ``bounds``) and overlays only
the fields a request actually gave on the spec's section (``SamplingOptions.merged``).
``params()`` resolves it into the engine's frozen ``SamplingParams``: an unset seed becomes a
fresh random one, so unseeded sampled requests differ and each reports the seed it used.
"""

from __future__ import annotations

import secrets
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, InstanceOf, field_validator

# the bounds live in .bounds (SamplingParams checks them too); the API imports them from here
from .bounds import (MAX_LOGPROBS, MAX_NEW_TOKENS, MAX_SEED, LogitBias, NewTokens, Penalty,  # noqa: F401
                     RepetitionPenalty, Seed, Temperature, TokenId, TopK, TopLogprobs, TopP)
from .grammar import Constraint
from .sampling import SamplingParams


def fresh_seed() -> int:
    return secrets.randbelow(MAX_SEED + 1)


def nth_seed(seed: int, i: int) -> int:
    """The seed of a request's i-th independent choice (n > 1)."""
    return (seed + i) & MAX_SEED


class SamplingOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: Temperature = 0.0
    top_k: TopK = -1  # -1 or 0: off
    top_p: TopP = 1.0
    max_new_tokens: NewTokens | None = 128  # None: the rest of the context (max_model_len)
    min_new_tokens: NewTokens = 0  # EOS and stop ids are masked until this many tokens
    seed: Seed | None = None  # None: a fresh random seed per request, reported in meta_info
    stop: list[str] = Field(default_factory=list)  # stop strings (excluded from the text)
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: Penalty = 0.0  # subtracted once from every token already generated
    frequency_penalty: Penalty = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: RepetitionPenalty = 1.0  # divides positive / multiplies negative logits seen in prompt or output
    logit_bias: LogitBias = Field(default_factory=dict)  # token id -> added to its logit
    logprobs: TopLogprobs | None = None  # None: no logprobs; n: each output token's and its n top alternatives'
    prompt_logprobs: TopLogprobs | None = None  # the same for the prompt's tokens (echo)
    constraint: InstanceOf[Constraint] | None = None  # structured output (a request's response_format and kin)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    def merged(self, given: dict[str, Any]) -> "SamplingOptions":
        """These options (the spec's defaults) with the fields a request gave overlaid. A
        request's explicit null keeps the default, except where null means something itself
        (max_new_tokens: the rest of the context; seed: a fresh one)."""
        keep_null = {"max_new_tokens", "seed", "logprobs", "prompt_logprobs"}
        given = {k: v for k, v in given.items() if v is not None or k in keep_null}
        return SamplingOptions.model_validate({**dict(self), **given})

    def params(self, **overrides: Any) -> SamplingParams:
        """The engine's parameters (overrides that are None keep these options' values)."""
        fields = {**dict(self), **{k: v for k, v in overrides.items() if v is not None}}
        stops = fields.pop("stop")
        if fields["seed"] is None:
            fields["seed"] = fresh_seed()
        fields["stop_token_ids"] = tuple(fields["stop_token_ids"])
        fields["logit_bias"] = tuple(sorted(fields["logit_bias"].items()))
        return SamplingParams(**fields, stop=tuple(s for s in stops if s))
