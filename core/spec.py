"""The spec file: the only user-facing configuration (pydantic v2, unknown fields rejected).

``speculative`` is a union discriminated by ``method``: the method registry maps each name
to its own section model, so a method added in one new file brings its spec fields with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_validator,
)

from .models.config import ConfigError, ModelConfig, read_model_config
from .models.presets import TARGET_PRESETS, target_preset
from .registry import METHODS, RegistryError
from .options import SamplingOptions
from .sampling import MAX_SEED


class SpecError(ValueError):
    """A spec that failed validation; ``messages`` name each bad field and its fix."""

    def __init__(self, source: str, messages: list[str]):
        self.source, self.messages = source, messages
        super().__init__(f"{source}: invalid spec\n" + "\n".join(f"  - {m}" for m in messages))


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RandomInit(Strict):
    preset: str
    seed: int = Field(0, ge=0, le=MAX_SEED)


def _one_source(path: Path | None, random_init: RandomInit | None, where: str) -> None:
    if (path is None) == (random_init is None):
        raise ValueError(f"{where}: give exactly one of `path` (a checkpoint folder) or `random_init`")


class ModelSpec(Strict):
    path: Path | None = None
    random_init: RandomInit | None = None
    tokenizer: Path | None = None  # defaults to the checkpoint folder's tokenizer.json
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int = Field(2048, ge=2)
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    enforce_eager: bool = False  # cuda backend: run every step eagerly instead of replaying CUDA graphs
    # cuda backend: the target's decode and verify rows take one kernel path whose reductions are
    # fixed by the weights' shapes, so a row's tokens do not depend on the rows beside it (drafting
    # and batching never change a bf16 token). Unset: on wherever the method's verify window fits
    # the invariant attention tile (every shipped spec), with a warning where it does not; true:
    # required (start-up refuses a window that does not fit); false: off (2-4% faster at batch 1
    # on an 8B model, docs/RESULTS.md).
    batch_invariant: bool | None = None
    # ranks the target is split over (heads, KV heads and the MLP width each divided by it); one
    # process per rank on torch.distributed, started by draftline.core.parallel (reference backend)
    tensor_parallel_size: int = Field(1, ge=1, le=64)

    @model_validator(mode="after")
    def _source(self) -> "ModelSpec":
        _one_source(self.path, self.random_init, "model")
        if self.random_init is not None and self.random_init.preset not in TARGET_PRESETS:
            known = ", ".join(sorted(TARGET_PRESETS))
            raise ValueError(f"model.random_init.preset: unknown preset {self.random_init.preset!r}; known: {known}")
        return self

    def config(self, read_files: bool) -> ModelConfig | None:
        """The target's config: from the preset, or from config.json when ``read_files``."""
        if self.random_init is not None:
            return target_preset(self.random_init.preset)
        return read_model_config(self.path) if read_files else None


class DraftModelSpec(Strict):
    """Where a drafter's weights come from."""

    path: Path | None = None
    random_init: RandomInit | None = None

    @model_validator(mode="after")
    def _source(self) -> "DraftModelSpec":
        _one_source(self.path, self.random_init, "speculative.draft")
        return self


class SpeculativeSpec(Strict):
    """Fields every method has; each method's section model extends this."""

    method: str
    draft_sample_method: Literal["greedy", "probabilistic"] = "greedy"
    # When to draft, and how wide to verify: "auto" measures time per emitted token of plain
    # decoding, the full verify and the narrower ones the backend runs, for each batch size, and
    # picks the fastest; an integer drafts (full width) only while at most that many requests
    # run; "always" always verifies the full width.
    max_draft_batch: int | Literal["auto", "always"] = Field("auto")

    @field_validator("max_draft_batch")
    @classmethod
    def _positive(cls, value: Any) -> Any:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be >= 1, or 'auto' / 'always'")
        return value

    def check(self, target: ModelConfig | None, read_files: bool) -> list[str]:
        """Cross-field checks against the target (None when unknown); messages name the field."""
        return []


class ServerSpec(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    max_batch_size: int = Field(8, ge=1, le=1024)
    max_queue: int = Field(256, ge=1)
    # prompt tokens one step prefills at most, across the requests it admits (vLLM's name): a
    # burst of arrivals is prefilled over several steps, between the running requests' rounds,
    # and a longer prompt in chunks (the reference backend; the cuda backend with
    # model.batch_invariant, its default: otherwise it takes a longer prompt whole, alone).
    max_num_batched_tokens: int = Field(8192, ge=1)
    # while requests decode, a step's prefill may take at most this many of their rounds' time
    # (both as measured on this machine): a prefill launched between rounds holds back every
    # stream's next tokens, so a burst of arrivals is then prefilled over several steps, and a
    # stream's longest gap stays near 1 + this times its usual one, for fewer rows a round.
    # null (default): only max_num_batched_tokens bounds a step's prefill
    max_prefill_stall: float | None = Field(None, gt=0)
    # steps new requests may wait while others run, so arrivals are prefilled together (each
    # prefill launch reads the target's weights once; TGI's max_waiting_tokens): once a waiting
    # request could take a free slot, it is admitted when this many steps have passed, when a
    # quarter of max_batch_size could go at once, or when nothing runs. 0: at the next step
    admission_wait: int = Field(0, ge=0)
    # prompts' full blocks of block_size tokens are kept after their requests and reused by
    # later prompts that start alike (the reference backend; the cuda backend with its chunked
    # prefill, as pages of its KV pool that later requests map into their tables)
    enable_prefix_caching: bool = True
    block_size: int = Field(16, ge=1, le=1024)
    # KV blocks (of block_size tokens) the running requests may hold together: requests are
    # admitted while their prompts' blocks last, and the newest preempted (recomputed later,
    # with the same output: exact with model.batch_invariant on the cuda backend, its default)
    # when the others' next rounds need more. On the cuda backend the target's KV is then a
    # paged pool of that many blocks, taken by requests as they grow, so the slots
    # (max_batch_size) no longer each hold a whole context. null: every running request
    # can hold a whole max_model_len context (a static slot each), so none is ever preempted
    num_kv_blocks: int | None = Field(None, ge=1)
    # the share of the GPU's memory the engine may hold (vLLM's name; the cuda backend): set, the
    # KV is paged (as with num_kv_blocks) in a pool of every block that fits once the weights are
    # loaded and a workspace for the largest forward is set aside. num_kv_blocks, when also set,
    # fixes the pool instead. null: static slots (or num_kv_blocks' pool)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    # the name of an environment variable holding a bearer token: every route but /health then
    # needs `Authorization: Bearer <token>`; the server refuses to start if it is unset or empty
    api_key_env: str | None = Field(None, min_length=1)
    # the names a request's `model` may give (vLLM's served_model_name); the first is the one
    # reported. A request naming another model gets a 404. null: the checkpoint folder's name
    # (random weights: random-<preset>)
    served_model_name: str | list[str] | None = None
    # A request's limits, checked before any work is done for it (a 400 names the field; a
    # body over max_request_bytes is a 413, refused unread). A body is parsed on the event
    # loop: 8 MiB of token ids held /health about 0.3 s on a 2-core CPU.
    max_request_bytes: int = Field(8 * 2**20, ge=1024)
    max_prompt_chars: int | None = Field(None, ge=1)  # each prompt's; null: 32 per token of model.max_model_len
    max_stop_strings: int = Field(64, ge=0)  # stop strings per request
    max_stop_chars: int = Field(1024, ge=1)  # the longest stop string
    max_n: int = Field(16, ge=1)  # n and best_of: completions per prompt
    max_logit_bias: int = Field(1024, ge=0)  # logit_bias entries
    # on SIGTERM or SIGINT: no new requests, the waiting ones aborted, the running ones given
    # this long to finish (then aborted), exit 0; a second signal exits at once
    shutdown_timeout_s: float = Field(30.0, ge=0, le=86400, allow_inf_nan=False)
    # rounds a request may have in flight while the host books the one before: 0 launches and
    # collects each round in turn; 1 or 2 let the device run ahead of the host. "auto" takes the
    # backend's fastest measured depth (the reference backend runs synchronously: 0).
    pipeline_depth: int | Literal["auto"] = Field("auto")

    @field_validator("pipeline_depth")
    @classmethod
    def _depth(cls, value: Any) -> Any:
        if isinstance(value, int) and not 0 <= value <= 2:
            raise ValueError("must be 0, 1 or 2 (rounds in flight), or 'auto'")
        return value

    @field_validator("served_model_name")
    @classmethod
    def _names(cls, value: Any) -> Any:
        names = [value] if isinstance(value, str) else value
        if names is not None and (not names or not all(n.strip() for n in names)):
            raise ValueError("give a name, or a list of names (the first is reported), none of them empty")
        return value


def _speculative(data: Any) -> Any:
    if isinstance(data, SpeculativeSpec):
        return data
    if not isinstance(data, dict) or "method" not in data:
        raise ValueError("speculative: needs a `method` field (e.g. method: dflash)")
    try:
        method = METHODS.get(str(data["method"]))
    except RegistryError as exc:
        raise ValueError(f"speculative.method: {exc}") from None
    return method.config_model.model_validate(data)


class Spec(Strict):
    description: str = ""
    model: ModelSpec
    speculative: SerializeAsAny[SpeculativeSpec] = Field(default_factory=lambda: _speculative({"method": "none"}))
    backend: Literal["reference", "cuda", "auto"] = "auto"
    sampling: SamplingOptions = Field(default_factory=SamplingOptions)
    server: ServerSpec = Field(default_factory=ServerSpec)

    @field_validator("sampling")
    @classmethod
    def _generates(cls, value: SamplingOptions) -> SamplingOptions:
        if value.max_new_tokens == 0:  # a request may ask for 0 (its prompt's logprobs); a default may not
            raise ValueError("sampling.max_new_tokens: must be >= 1 as every request's default (or null: the rest of the context)")
        return value

    @field_validator("speculative", mode="before")
    @classmethod
    def _method_section(cls, value: Any) -> Any:
        return _speculative(value)

    @model_validator(mode="after")
    def _cross(self) -> "Spec":
        target = self.model.config(read_files=False)
        problems = self.speculative.check(target, read_files=False) + _parallel_problems(self, target)
        if problems:
            raise ValueError("\n".join(problems))  # format_errors gives each its own line
        return self

    def with_method(self, speculative: dict[str, Any] | SpeculativeSpec) -> "Spec":
        data = self.model_dump(mode="python")
        data["speculative"] = speculative
        return Spec.model_validate(data)


FRIENDLY = {
    "extra_forbidden": "unknown field; remove it or fix its spelling",
    "missing": "required field is missing",
}


def format_errors(exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
        for msg in FRIENDLY.get(err["type"], err["msg"].removeprefix("Value error, ")).split("\n"):
            out.append(f"{loc}: {msg}" if loc and not msg.startswith(loc) else msg)
    return out


def parse_spec(data: Any, source: str = "<spec>") -> Spec:
    if not isinstance(data, dict):
        raise SpecError(source, ["the spec must be a YAML mapping with at least a `model` section"])
    try:
        return Spec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(source, format_errors(exc)) from None


def load_spec(path: str | Path) -> Spec:
    path = Path(path)
    if not path.is_file():
        raise SpecError(str(path), ["file not found; pass the path of a YAML spec (see specs/)"])
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise SpecError(str(path), ["not a text file (not UTF-8); pass the path of a YAML spec (see specs/)"]) from None
    except yaml.YAMLError as exc:
        raise SpecError(str(path), [f"not valid YAML: {exc}"]) from None
    spec = parse_spec(data, str(path))
    return _resolve_paths(spec, path.parent)


def _resolve_paths(spec: Spec, base: Path) -> Spec:
    """Relative checkpoint paths in a spec file are relative to the file's folder."""
    data = spec.model_dump(mode="python")

    def fix(section: dict[str, Any] | None, key: str) -> None:
        if section and section.get(key) is not None and not Path(section[key]).is_absolute():
            section[key] = (base / section[key]).resolve()

    fix(data["model"], "path")
    fix(data["model"], "tokenizer")
    fix(data["speculative"].get("draft"), "path")
    return Spec.model_validate(data)


def check_files(spec: Spec) -> list[str]:
    """Open the checkpoints' config.json files and safetensors headers, re-run the
    cross-field checks with them, and check that this machine has the spec's device."""
    try:
        target = spec.model.config(read_files=True)
    except ConfigError as exc:
        return [f"model.path: {exc}"] + device_problems(spec)
    problems = spec.speculative.check(target, read_files=True) + _parallel_problems(spec, target)
    draft = getattr(spec.speculative, "draft", None)
    for field, folder in (("model.path", spec.model.path), ("speculative.draft.path", getattr(draft, "path", None))):
        if folder is not None and (Path(folder) / "config.json").is_file():  # a missing one is reported already
            problems += _weights_problems(field, folder)
    return problems + device_problems(spec)


def _parallel_problems(spec: "Spec", target: ModelConfig | None) -> list[str]:
    """model.tensor_parallel_size against the backend and the target's heads (when known)."""
    size = spec.model.tensor_parallel_size
    if size == 1:
        return []
    if spec.backend == "cuda":
        return [f"model.tensor_parallel_size {size}: runs on the reference backend for now (gloo); set backend: "
                "reference or tensor_parallel_size: 1"]
    from .models.shard import check_divisible

    try:
        if target is not None:
            check_divisible(target, size)
    except ConfigError as exc:
        return [str(exc)]
    return []


def _weights_problems(field: str, folder: Path) -> list[str]:
    from .models.checkpoint import CheckpointError, tensor_files

    try:
        tensor_files(folder)
    except CheckpointError as exc:
        return [f"{field}: {exc}"]
    return []


def device_problems(spec: Spec) -> list[str]:
    """The spec's device on this machine: a CUDA device that torch cannot see."""
    import torch

    device = spec.model.device
    if not device.startswith("cuda"):
        return []
    if not torch.cuda.is_available():
        return [f"model.device: {device}, but torch sees no CUDA device on this machine "
                f"(torch {torch.__version__}); set model.device: auto or cpu, or run on a GPU machine"]
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        return [f"model.device: {device}, but this machine has {torch.cuda.device_count()} CUDA device(s); "
                f"use cuda:0..cuda:{torch.cuda.device_count() - 1}"]
    return []
