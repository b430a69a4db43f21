"""The bounds of every sampling value, in one place: the spec's ``sampling:`` section, every
API's request fields, the command line's flags and ``SamplingParams`` itself check against
these types, so a value refused by one is refused by all (NaN and infinities included)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, InstanceOf, Strict, TypeAdapter, ValidationError

from .errors import RequestError
from .grammar import Constraint

MAX_SEED = 2**63 - 1
MAX_NEW_TOKENS = 1 << 20  # a sanity bound; the real one is max_model_len, checked per request
MAX_LOGPROBS = 20  # top alternatives per position, as OpenAI allows


def _real(**bounds: float) -> Any:
    return Annotated[float, Field(allow_inf_nan=False, **bounds)]


Temperature = _real(ge=0.0, le=100.0)
TopP = _real(gt=0.0, le=1.0)
TopK = Annotated[int, Field(ge=-1, le=2**31 - 1)]  # -1 or 0: off; a tensor of int64 carries it
NewTokens = Annotated[int, Field(ge=0, le=MAX_NEW_TOKENS)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
Penalty = _real(ge=-2.0, le=2.0)  # presence / frequency, OpenAI's range
RepetitionPenalty = _real(gt=0.0, le=10.0)
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
TokenId = Annotated[int, Field(ge=0)]
Bias = _real(ge=-100.0, le=100.0)
# JSON object keys are strings: a logit_bias key is an integer written as one, even in a
# request model that takes no string for a number anywhere else
LogitBias = dict[Annotated[int, Field(ge=0), Strict(False)], Bias]

# SamplingParams' fields and their types (a tuple field takes a list as well: checked, not converted)
_PARAMS = {
    "temperature": Temperature, "top_k": TopK, "top_p": TopP, "max_new_tokens": NewTokens | None,
    "min_new_tokens": NewTokens, "seed": Seed, "stop_token_ids": tuple[TokenId, ...] | list[TokenId],
    "ignore_eos": bool, "stop": tuple[str, ...] | list[str], "presence_penalty": Penalty,
    "frequency_penalty": Penalty, "repetition_penalty": RepetitionPenalty,
    "logit_bias": tuple[tuple[TokenId, Bias], ...] | list[tuple[TokenId, Bias]],
    "logprobs": TopLogprobs | None, "prompt_logprobs": TopLogprobs | None,
    "constraint": InstanceOf[Constraint] | None,
}
_ADAPTERS: dict[str, TypeAdapter] = {}


def check_params(values: dict[str, Any]) -> None:
    """Each sampling parameter within its bounds, or RequestError naming the first that is not."""
    for name, value in values.items():
        adapter = _ADAPTERS.get(name)
        if adapter is None:
            adapter = _ADAPTERS[name] = TypeAdapter(_PARAMS[name], config={"strict": True})
        try:
            adapter.validate_python(value)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = "".join(f"[{p}]" for p in err["loc"])
            raise RequestError(f"SamplingParams.{name}{where}: {err['msg'].lower()} (got {value!r:.60})", param=name) from None
