"""Request and response shapes: SGLang's native /generate and OpenAI's /v1/completions."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.sampling import MAX_SEED, SamplingParams

MAX_NEW_TOKENS = 1 << 20  # a sanity bound; the real one is max_model_len, checked per request


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingIn(Strict):
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    max_new_tokens: int = Field(128, ge=1, le=MAX_NEW_TOKENS)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    sampling_seed: int | None = Field(None, ge=0, le=MAX_SEED)

    def params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, max_new_tokens=self.max_new_tokens,
            seed=self.sampling_seed or 0, stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos,
        )

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class GenerateRequest(Strict):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingIn = Field(default_factory=SamplingIn)
    stream: bool = False
    speculative: bool = True  # False: never draft for this request
    rid: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> "GenerateRequest":
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of `text` or `input_ids`")
        return self

    @property
    def prompt(self) -> str | list[int]:
        return self.text if self.text is not None else self.input_ids


class CompletionRequest(Strict):
    model: str | None = None
    prompt: str | list[int]
    max_tokens: int = Field(16, ge=1, le=MAX_NEW_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    n: Literal[1] = 1
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    user: str | None = None

    def sampling(self) -> SamplingIn:
        return SamplingIn(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                          max_new_tokens=self.max_tokens, stop=self.stop, sampling_seed=self.seed)
