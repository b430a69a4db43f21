"""Request shapes: SGLang's native /generate and OpenAI's /v1/completions and /v1/chat/completions.

Each maps its own field names onto draftline.core.options.SamplingOptions (same bounds, the shared
``Annotated`` types) and gives only the fields the request set, so the spec's ``sampling:``
section supplies every default. Types are strict, as OpenAI's and vLLM's are: ``"stream": "yes"``
or ``"max_tokens": "5"`` is refused, not read as true or 5. Sizes (n, best_of, stop strings,
prompts) are bounded by the spec (api/limits.py), not here. Fields OpenAI defines that
draftline does not implement are declared here so that a request using one gets a 400 naming
it (``unimplemented``)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from draftline.core.engine import RequestError
from draftline.core.options import (LogitBias, NewTokens, Penalty, RepetitionPenalty, SamplingOptions, Seed, Temperature,
                          TokenId, TopK, TopLogprobs, TopP)

from .structured import ResponseFormat, StructuredOutputs, native_constraint, openai_constraint
from .tools import Tool, ToolChoice, ToolPlan


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    def given(self, names: dict[str, str]) -> dict[str, Any]:
        """{options field: value} for the request fields in ``names`` (wire name -> option name) it set."""
        return {names[k]: getattr(self, k) for k in self.model_fields_set if k in names}


Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


def prompt_list(prompt: Prompt) -> list[str | list[int]]:
    """One prompt per choice group: a string, a list of strings, a list of ids or a list of id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        return [[]]  # the engine names the problem (an empty prompt)
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


class NativeSampling(Strict):
    """SGLang's sampling_params."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    max_new_tokens: NewTokens | None = None
    min_new_tokens: NewTokens | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    sampling_seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: LogitBias | None = None
    n: int = Field(1, ge=1)
    json_schema: str | None = None  # structured output: a JSON schema's text, a regex or an EBNF grammar
    regex: str | None = None
    ebnf: str | None = None

    NAMES: ClassVar[dict[str, str]] = {k: k for k in (
        "temperature", "top_p", "top_k", "max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "ignore_eos",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")} | {"sampling_seed": "seed"}


class GenerateRequest(Strict):
    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: NativeSampling = Field(default_factory=NativeSampling)
    stream: bool = False
    speculative: bool = True  # False: never draft for this request
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: TopLogprobs = 0
    logprob_start_len: int = Field(-1, ge=-1)  # -1: output tokens only; s: prompt tokens from s on too

    @model_validator(mode="after")
    def _one_prompt(self) -> "GenerateRequest":
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of `text` or `input_ids`")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        return prompt_list(self.text if self.text is not None else self.input_ids)

    @property
    def batched(self) -> bool:
        p = self.text if self.text is not None else self.input_ids
        return isinstance(p, list) and bool(p) and not all(isinstance(x, int) for x in p)

    def options(self, defaults: SamplingOptions) -> SamplingOptions:
        given = self.sampling_params.given(NativeSampling.NAMES)
        sp = self.sampling_params
        given["constraint"] = native_constraint(sp.json_schema, sp.regex, sp.ebnf)
        if self.return_logprob:
            given["logprobs"] = self.top_logprobs_num
            if self.logprob_start_len >= 0:
                given["prompt_logprobs"] = self.top_logprobs_num
        return defaults.merged(given)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


class OpenAIBase(Strict):
    """Fields shared by OpenAI's completions and chat completions (and vLLM's common extensions)."""

    model: str | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None  # informational
    # vLLM's extensions that harnesses send
    top_k: TopK | None = None
    min_tokens: NewTokens | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    # structured output: OpenAI's response_format, vLLM's structured_outputs and guided_* (one of them)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    NAMES: ClassVar[dict[str, str]] = {k: k for k in (
        "temperature", "top_p", "top_k", "stop", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "logit_bias", "ignore_eos", "stop_token_ids")} | {"min_tokens": "min_new_tokens", "max_tokens": "max_new_tokens"}
    UNIMPLEMENTED: ClassVar[tuple[str, ...]] = ()

    def unimplemented(self) -> list[str]:
        """The OpenAI fields this request sets that draftline does not implement."""
        return [k for k in self.UNIMPLEMENTED if getattr(self, k) not in (None, False, [], {})]

    def given_sampling(self) -> dict[str, Any]:
        """The sampling fields this request set, its constraint among them."""
        guided = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        return self.given(self.NAMES) | {"constraint": openai_constraint(self.response_format,
                                                                         self.structured_outputs, guided)}

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(OpenAIBase):
    prompt: Prompt
    max_tokens: NewTokens | None = None  # omitted: the spec's max_new_tokens; null: the rest of the context
    echo: bool = False
    logprobs: TopLogprobs | None = None
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None  # not implemented (insertion)

    UNIMPLEMENTED: ClassVar[tuple[str, ...]] = ("suffix",)

    def options(self, defaults: SamplingOptions) -> SamplingOptions:
        given = self.given_sampling()
        if self.logprobs is not None or self.choices > self.n:  # best_of ranks by the target's logprobs
            given["logprobs"] = self.logprobs or 0
        if self.echo and self.logprobs is not None:
            given["prompt_logprobs"] = self.logprobs
        return defaults.merged(given)

    @property
    def choices(self) -> int:
        """Completions generated per prompt (best_of of them, of which n are returned)."""
        return max(self.n, self.best_of or self.n)

    @model_validator(mode="after")
    def _best_of(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError("best_of must be >= n")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise ValueError("best_of > n cannot stream (the best are known only at the end); drop stream or best_of")
        return self


class ContentPart(BaseModel):
    """One part of a message's content: {"type": "text", "text": ...}; other types (image_url,
    input_audio, file, ...) are named in a 400, since the targets draftline serves read text."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class Message(BaseModel):
    """A chat message; fields beyond role and content (name, tool_call_id, ...) reach the template as given."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[ContentPart] | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as the template reads it: list content's text parts joined by newlines
        (as vLLM joins them for templates that take string content)."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.type != "text":
                    raise RequestError(f"content part of type {part.type!r}: not supported (draftline serves "
                                       "text-only models); send {\"type\": \"text\", \"text\": ...} parts or a string")
                if part.text is None:
                    raise RequestError("a content part of type 'text' needs a `text` string")
                texts.append(part.text)
            out["content"] = "\n".join(texts)
        return out


class ChatRequest(OpenAIBase):
    messages: list[Message] = Field(min_length=1)
    max_tokens: NewTokens | None = None  # deprecated name of max_completion_tokens
    max_completion_tokens: NewTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    # vLLM's template controls
    add_generation_prompt: bool = True  # end the prompt with the assistant's turn opening
    continue_final_message: bool = False  # end it inside the last message instead: the model continues it
    chat_template_kwargs: dict[str, Any] | None = None  # further template variables (these two may be among them)
    # OpenAI fields draftline does not implement; their default (or a harmless value) is accepted
    audio: Any = None
    function_call: Any = None
    functions: Any = None
    modalities: Any = None
    parallel_tool_calls: bool | None = None
    prediction: Any = None
    reasoning_effort: Any = None
    service_tier: Any = None
    store: Any = None
    metadata: Any = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    web_search_options: Any = None
    verbosity: Any = None

    UNIMPLEMENTED: ClassVar[tuple[str, ...]] = (
        "audio", "function_call", "functions", "modalities", "prediction", "reasoning_effort",
        "service_tier", "store", "metadata", "web_search_options", "verbosity")
    HARMLESS: ClassVar[dict[str, list[Any]]] = {"modalities": [["text"]], "service_tier": ["auto", "default"]}

    def unimplemented(self) -> list[str]:
        return [k for k in super().unimplemented() if getattr(self, k) not in self.HARMLESS.get(k, [])]

    def tool_plan(self) -> ToolPlan | None:
        return ToolPlan.of(self.tools, self.tool_choice, self.parallel_tool_calls)

    def options(self, defaults: SamplingOptions) -> SamplingOptions:
        given = self.given_sampling()
        plan = self.tool_plan()
        forced = None if plan is None else plan.constraint()
        if forced is not None and given["constraint"] is not None:
            raise RequestError("tool_choice (required or a named function) holds the output to the calls' schema; "
                               "drop response_format / guided_* or set tool_choice to auto", "tool_choice")
        if forced is not None:
            given["constraint"] = forced
        if "max_completion_tokens" in self.model_fields_set:
            given["max_new_tokens"] = self.max_completion_tokens
        if self.logprobs:
            given["logprobs"] = self.top_logprobs or 0
        return defaults.merged(given)

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template renders with besides the messages: add_generation_prompt,
        continue_final_message and chat_template_kwargs (which override the first two, as in vLLM)."""
        kwargs = {"add_generation_prompt": self.add_generation_prompt,
                  "continue_final_message": self.continue_final_message} | (self.chat_template_kwargs or {})
        if "messages" in kwargs:
            raise RequestError("chat_template_kwargs: `messages` is the request's own; drop it from chat_template_kwargs")
        if kwargs["add_generation_prompt"] and kwargs["continue_final_message"]:
            raise RequestError("continue_final_message and add_generation_prompt cannot both be true: set "
                               "add_generation_prompt: false to continue the final message")
        return kwargs

    @model_validator(mode="after")
    def _top_logprobs(self) -> "ChatRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self
