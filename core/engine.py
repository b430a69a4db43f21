"""The facade: ``Engine.from_spec(path).generate(prompts, sampling)``."""

from __future__ import annotations

import functools
import itertools
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import structlog
import torch
from tokenizers import Tokenizer

from .blocks import BlockPool
from .contract import Capacity
from .detokenizer import TextStream
from .errors import RequestError
from .grammar import Grammars
from .models.shard import ShardedTarget
from .parallel import current_shard
from .logprobs import TokenLogprob
from .machine import Machine, Plan
from .policy import DraftPolicy
from .models.chat_template import load_chat_template
from .models.config import ConfigError
from .models.loader import load_target, place, random_target
from .models.target import TargetModel
from .models.tokenizer import byte_tokenizer, load_tokenizer
from .pacer import Pacer
from .registry import BACKENDS, METHODS
from .request import Request, Round, SpecStats
from .sampling import SamplingParams
from .scheduler import Scheduler
from .stops import Stops
from .spec import Spec, SpeculativeSpec, device_problems, load_spec

log = structlog.get_logger("draftline.engine")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Completion:
    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]
    rounds: list[Round] | None = field(default=None)
    logprobs: list[TokenLogprob] | None = None  # one per output token (params.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token, None for the first
    prompt_ids: list[int] = field(default_factory=list)

    def to_dict(self, trace: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"text": self.text, "output_ids": self.output_ids, "meta_info": self.meta_info}
        if trace and self.rounds is not None:
            out["rounds"] = [r.__dict__ | {"drafted": list(r.drafted), "emitted": list(r.emitted)} for r in self.rounds]
        return out


def resolve_device(spec: Spec) -> torch.device:
    if spec.model.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    problems = device_problems(spec)
    if problems:
        raise ConfigError(problems[0])
    return torch.device(spec.model.device)


def resolve_backend(spec: Spec, device: torch.device) -> str:
    if spec.backend == "auto":
        return "cuda" if device.type == "cuda" and "cuda" in BACKENDS.names() else "reference"
    if spec.backend == "cuda" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("backend: cuda needs a CUDA device (model.device: cuda or auto on a GPU machine); "
                          "on a CPU use backend: reference")
    return spec.backend


def resolve_dtype(spec: Spec, backend: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 for the cuda backend on a GPU, float32 otherwise. The cuda backend's
    kernels interpreted on a CPU (TRITON_INTERPRET=1) are exact in float32 only: numpy has no
    bfloat16, and the interpreter's half-precision products are not a GPU's (wrong tokens)."""
    name = spec.model.dtype
    if name == "auto":
        return torch.bfloat16 if backend == "cuda" and device.type == "cuda" else torch.float32
    if backend == "cuda" and device.type != "cuda" and name != "float32":
        raise ConfigError(f"model.dtype: {name} with backend: cuda on a CPU: the Triton interpreter does not compute "
                          f"{name} as a GPU does and would give wrong tokens; use model.dtype: float32 (or auto) "
                          "there, or backend: reference")
    return DTYPES[name]


def build_target(spec: Spec, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> tuple[TargetModel, Tokenizer]:
    """The spec's target (at model.tensor_parallel_size > 1, this rank's shard) and tokenizer."""
    m = spec.model
    shard = current_shard(m.tensor_parallel_size) if m.tensor_parallel_size > 1 else None
    if m.random_init is not None:
        target = random_target(m.random_init.preset, m.random_init.seed, device, dtype)
        target = target if shard is None else ShardedTarget.from_whole(target, shard)
        tokenizer = load_tokenizer(m.tokenizer) if m.tokenizer else byte_tokenizer(target.config.vocab_size)
    else:
        target = load_target(m.path, shard)
        tokenizer = load_tokenizer(m.tokenizer or m.path)
    if shard is not None:
        log.info("tensor_parallel.shard", rank=shard.rank, size=shard.size,
                 target_bytes=sum(t.numel() * t.element_size() for t in target.state_dict().values()))
    return target, tokenizer


def kv_lookahead(plan: Plan, depth: int) -> int:
    """Positions past its booked length a request's rounds in flight (``depth`` beyond the one
    being booked) may write: a window, or a DFlash block, each."""
    return (depth + 1) * max(plan.num_speculative_tokens + 1, plan.block_size or 0)


def kv_blocks(spec: Spec, lookahead: int, pages: int = 0) -> BlockPool:
    """The KV pool in blocks: the backend's paged pool (``pages``: server.num_kv_blocks, or what
    server.gpu_memory_utilization fits), or a whole context for every running request."""
    size = spec.server.block_size
    total = pages or spec.server.max_batch_size * -(-(spec.model.max_model_len + lookahead) // size)
    return BlockPool(size, total, lookahead)


class Engine:
    def __init__(self, spec: Spec, target: TargetModel | None = None, tokenizer: Tokenizer | None = None,
                 draft_policy: int | str | None = None):
        """``draft_policy`` overrides the spec's ``speculative.max_draft_batch`` (e.g. "always"
        to measure a method itself)."""
        self.spec = spec
        self.device = resolve_device(spec)
        self.backend_name = resolve_backend(spec, self.device)
        self.dtype = resolve_dtype(spec, self.backend_name, self.device)
        if target is None:
            target, tokenizer = build_target(spec, self.device, self.dtype)
            place(target, self.device, self.dtype)
        if spec.model.tensor_parallel_size > 1 and not isinstance(target, ShardedTarget):
            raise ConfigError("model.tensor_parallel_size > 1: pass no target (each rank builds its shard), or a "
                              "ShardedTarget")
        self.target, self.tokenizer = target, tokenizer
        self.chat_template = load_chat_template(spec.model.tokenizer or spec.model.path)  # None: the checkpoint has none
        method = METHODS.get(spec.speculative.method)(spec.speculative)
        self.plan: Plan = method.plan(target.config)
        backend = BACKENDS.get(self.backend_name)
        depth = spec.server.pipeline_depth
        depth = min(backend.default_depth if depth == "auto" else depth, backend.max_depth)
        capacity = Capacity(spec.server.max_batch_size, spec.model.max_model_len, graphs=not spec.model.enforce_eager,
                            invariant=spec.model.batch_invariant is not False,
                            invariant_required=spec.model.batch_invariant is True,
                            prefix_block=spec.server.block_size if spec.server.enable_prefix_caching else 0,
                            kv_pages=spec.server.num_kv_blocks or 0, kv_page=spec.server.block_size,
                            kv_lookahead=kv_lookahead(self.plan, depth),
                            kv_memory=spec.server.gpu_memory_utilization or 0.0)
        self.backend = backend(target, method, self.plan, self.device, self.dtype, capacity)
        paged = spec.server.num_kv_blocks or getattr(self.backend, "kv_pages", 0)  # the cuda backend's pool
        self.blocks = kv_blocks(spec, capacity.kv_lookahead, paged)
        self.startup = self.backend.prepare()  # graphs for every bucket, before any request
        prefix = getattr(self.backend, "prefix", None)  # its PrefixCache (None: it caches no prefix)
        if capacity.prefix_block and prefix is None:
            log.info("prefix_caching.unavailable", backend=self.backend_name,
                     detail="every prompt is prefilled whole: the cuda backend caches prefixes with its "
                            "chunked prefill, which needs model.batch_invariant")
        # the server loop bounds its queue
        self.scheduler = Scheduler(spec.server.max_batch_size, spec.server.max_num_batched_tokens,
                                   chunked=getattr(self.backend, "chunked_prefill", False),
                                   pool=self.blocks if paged else None,  # unpaged: nothing to count
                                   admission_wait=spec.server.admission_wait,
                                   prefix=prefix, pacer=Pacer(spec.server.max_prefill_stall))
        self.policy = DraftPolicy(draft_policy or spec.speculative.max_draft_batch)
        self.stops = Stops(self._decode)
        self.machine = Machine(self.plan, self.backend, self.scheduler, self.policy, self.stops, depth)
        self._ids = itertools.count()

    @classmethod
    def from_spec(cls, spec: Spec | str | Path, draft_policy: int | str | None = None) -> "Engine":
        return cls(spec if isinstance(spec, Spec) else load_spec(spec), draft_policy=draft_policy)

    def with_method(self, speculative: dict[str, Any] | SpeculativeSpec) -> "Engine":
        """An engine for another method over the same target weights (e.g. the `none` baseline)."""
        return Engine(self.spec.with_method(speculative), self.target, self.tokenizer, self.policy.limit)

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        # encode_batch, not encode: only the batch call lets go of the GIL while it tokenizes, so
        # a long prompt tokenized in a worker thread does not stop the event loop (5 MB: 5 s)
        ids = self.tokenizer.encode_batch([prompt], add_special_tokens=False)[0].ids if isinstance(prompt, str) \
            else prompt
        vocab = self.target.config.vocab_size
        if not ids:
            raise RequestError("prompt is empty; give at least one token of text")
        if len(ids) >= self.spec.model.max_model_len:
            raise RequestError(
                f"prompt has {len(ids)} tokens, max_model_len is {self.spec.model.max_model_len}; "
                "shorten the prompt or raise model.max_model_len"
            )
        ids = [int(i) for i in ids]
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestError(f"input_ids must lie in [0, {vocab}); the target's vocabulary has {vocab} tokens")
        return ids

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams, trace: bool = False,
                    speculate: bool = True, stop: Sequence[str] = ()) -> Request:
        """Validate and queue a request (RequestError names what is wrong with it)."""
        req = self.make_request(prompt, params, trace, speculate, stop)
        self.scheduler.add(req)
        return req

    def make_request(self, prompt: str | Sequence[int], params: SamplingParams, trace: bool = False,
                     speculate: bool = True, stop: Sequence[str] = ()) -> Request:
        self._check_params(params)
        prompt_ids = self.encode(prompt)
        budget = self.spec.model.max_model_len - len(prompt_ids)
        if params.max_new_tokens is None:  # the rest of the context
            params = replace(params, max_new_tokens=budget)
        if params.max_new_tokens < 0:
            raise RequestError("max_new_tokens must be >= 0")
        if params.max_new_tokens > budget:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds max_model_len "
                f"({self.spec.model.max_model_len}); ask for at most {budget} new tokens"
            )
        blocks = self.blocks.most(len(prompt_ids), params.max_new_tokens)
        if blocks > self.blocks.total:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) needs "
                f"{blocks} KV blocks of {self.blocks.size} tokens "
                f"(with {self.blocks.lookahead} positions of lookahead), and the pool has {self.blocks.total} "
                "(server.num_kv_blocks, or what server.gpu_memory_utilization fits); ask for fewer tokens "
                "or raise server.num_kv_blocks or server.gpu_memory_utilization")
        eos = set() if params.ignore_eos else set(self.target.config.eos_token_ids)
        req = Request(
            rid=next(self._ids),
            prompt_ids=prompt_ids,
            params=params,
            stop_ids=frozenset(eos | set(params.stop_token_ids)),
            max_model_len=self.spec.model.max_model_len,
            stats=SpecStats(num_drafts=self.plan.num_speculative_tokens),
            rounds=[] if trace else None,
            speculate=speculate,
            stop_strings=tuple(s for s in (*stop, *params.stop) if s),
        )
        if params.constraint is not None:  # compiled here, so a bad one is the caller's RequestError
            stops = sorted(req.stop_ids) or sorted(self.target.config.eos_token_ids)
            req.grammar = self.grammars.matcher(params.constraint, stops)
        return req

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Constraints compiled for the target's tokenizer (xgrammar), built on first use."""
        return Grammars(self.tokenizer, self.target.config.vocab_size, sorted(self.target.config.eos_token_ids))

    @staticmethod
    def _grammar_meta(g) -> dict[str, Any]:
        """A constrained request's grammar costs: compile time (0 from the cache), host time for
        masks per round, the drafts the grammar forbade and kept (rejected at their slot) and
        those replaced by a token it allows (core.walk.chosen)."""
        per_round = 1e3 * g.mask_s / g.rounds if g.rounds else 0.0
        return {"grammar_compile_ms": round(g.compile_ms, 3), "grammar_mask_ms_per_round": round(per_round, 4),
                "grammar_refused_drafts": g.refused, "grammar_replaced_drafts": g.replaced}

    def _check_params(self, params: SamplingParams) -> None:
        """A request the backend cannot run exactly is refused, never run differently."""
        missing = params.features() - getattr(self.backend, "features", frozenset())
        if missing:
            raise RequestError(
                f"the {self.backend_name} backend does not implement {', '.join(sorted(missing))} yet "
                "(penalties: presence / frequency / repetition penalties, logit_bias, min_new_tokens; "
                "structured: response_format, guided_* and other constraints); "
                "drop those fields from the request, or serve a spec with backend: reference")
        vocab = self.target.config.vocab_size
        for name, ids in (("logit_bias", [i for i, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
            if any(not 0 <= i < vocab for i in ids):
                raise RequestError(f"{name}: token ids must lie in [0, {vocab}); the target's vocabulary has {vocab} tokens")

    def abort_running(self, message: str) -> None:
        """End every admitted request (after a step raised) and free their slots."""
        self.machine.abort_all(message)

    def step(self) -> list[Request]:
        return self.machine.step()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def text_stream(self) -> TextStream:
        """An incremental decoder of a request's output, for streaming it (the final text is
        ``text``'s)."""
        return TextStream(self._decode)

    def text(self, req: Request) -> str:
        """The completion text, cut before a matched stop string (which it does not include)."""
        text = self._decode(req.output_ids)
        if isinstance((req.finish_reason or {}).get("matched"), str):
            hit = self.stops.stop_at(req, text)
            if hit is not None:
                text = text[: hit[0]]
        return text

    def generate(
        self,
        prompts: str | Sequence[str | Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        trace: bool = False,
    ) -> list[Completion]:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or self.spec.sampling.params()] * len(prompts)
        reqs = [self.add_request(p, s, trace) for p, s in zip(prompts, sampling)]
        while self.scheduler.has_work():
            self.step()
        return [self.completion(r) for r in reqs]

    def completion(self, req: Request) -> Completion:
        s = req.stats
        elapsed = (req.t_finish or time.perf_counter()) - req.t_arrival
        meta = {
            "id": str(req.rid),
            "finish_reason": req.finish_reason,
            "prompt_tokens": len(req.prompt_ids),
            "cached_tokens": req.cached_tokens,  # prompt tokens whose KV the prefix cache gave
            **({} if req.grammar is None else self._grammar_meta(req.grammar)),
            "preemptions": req.preemptions,  # times its KV was dropped for blocks, and recomputed
            "completion_tokens": len(req.output_ids),
            "seed": req.params.seed,  # replay a sampled request with this seed
            "spec_verify_ct": s.verify_ct,
            "spec_accept_length": round(s.accept_length, 4),
            "spec_accept_rate": round(s.accept_rate, 4),
            "spec_accept_per_pos": [round(a, 4) for a in s.accept_per_pos],
            "spec_draft_tokens": s.draft_tokens,
            "spec_accepted_tokens": s.accepted_tokens,
            "spec_drafted_rounds": s.drafted_rounds,  # the draft policy may run plain rounds
            "spec_plain_rounds": s.verify_ct - s.drafted_rounds,
            "tokens_per_s": round(len(req.output_ids) / elapsed, 2) if elapsed > 0 else 0.0,
            "e2e_latency": round(elapsed, 4),
        }
        p, n = req.params, len(req.prompt_ids)
        out_lp = None if p.logprobs is None else [req.logprobs.get(n + k) for k in range(len(req.output_ids))]
        prompt_lp = None if p.prompt_logprobs is None else [None] + [req.logprobs.get(k) for k in range(1, n)]
        return Completion(text=self.text(req), output_ids=list(req.output_ids), meta_info=meta, rounds=req.rounds,
                          logprobs=out_lp, prompt_logprobs=prompt_lp, prompt_ids=list(req.prompt_ids))
