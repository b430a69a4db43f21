"""OpenAI's /v1/completions: list prompts, n / best_of, echo, logprobs, streaming with usage.

Every choice (and every streamed chunk's choice) carries ``seed``, the seed it was sampled
with: a request with that seed and n = 1 replays it, whether or not the request gave one
(an unseeded request draws a fresh seed per choice). OpenAI defines no such field; clients
read it as an extra attribute (the openai client's ``choice.seed``)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request as HTTPRequest

from draftline.core.engine import Completion, RequestError
from draftline.core.logprobs import TokenLogprob
from draftline.core.loop import EngineLoop

from . import fanout
from .limits import Limits
from .schemas import CompletionRequest, OpenAIBase, prompt_list
from .stream import sse


def finish_reason(c: Completion | None) -> str | None:
    if c is None:
        return None
    kind = (c.meta_info["finish_reason"] or {}).get("type")
    return {"length": "length", "stop": "stop"}.get(kind, "abort")


def usage(prompt_tokens: int, completions: list[Completion], cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; ``cached_tokens``: the prompt tokens the prefix cache gave."""
    done = sum(c.meta_info["completion_tokens"] for c in completions)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def refuse_unimplemented(body: OpenAIBase) -> None:
    names = body.unimplemented()
    if names:
        raise RequestError(f"{', '.join(names)}: not implemented by draftline; drop {'them' if len(names) > 1 else 'it'}",
                           names[0])


def check_sampling(body: OpenAIBase, limits: Limits) -> None:
    """The sizes an OpenAI request shares between completions and chat."""
    limits.stop(body.stop, "stop")
    limits.logit_bias(body.logit_bias, "logit_bias")


class Logprobs:
    """OpenAI's completions logprobs object, built token by token."""

    def __init__(self, decode_one, top_n: int | None):
        self.decode_one, self.top_n = decode_one, top_n
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []
        self.offset = 0

    def add(self, token: int, entry: TokenLogprob | None) -> None:
        text = self.decode_one(token)
        self.tokens.append(text)
        self.text_offset.append(self.offset)
        self.offset += len(text)
        self.token_logprobs.append(None if entry is None else entry.logprob)
        if entry is None:
            self.top_logprobs.append(None)
        else:  # the top n, and the chosen token itself (as vLLM reports it)
            top = {self.decode_one(t): lp for t, lp in entry.top[: self.top_n]}
            self.top_logprobs.append(top | {text: entry.logprob} if text not in top else top)

    def take(self) -> dict[str, Any]:
        out = {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
               "text_offset": self.text_offset}
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out


class CompletionsRoute:
    def __init__(self, loop: EngineLoop, body: CompletionRequest, model: str, limits: Limits):
        refuse_unimplemented(body)
        self.prompts = prompt_list(body.prompt)
        limits.prompts(self.prompts, "prompt")
        check_sampling(body, limits)
        limits.choices(body.n, body.best_of, len(self.prompts))
        self.loop, self.body = loop, body
        self.tokenizer = loop.engine.tokenizer
        self.options = body.options(loop.engine.spec.sampling)
        self.head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
                     "model": body.model or model}

    def decode_one(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def prompt_text(self, ids: list[int]) -> str:
        # the batch call lets go of the GIL while it decodes (a long prompt held the event loop)
        return self.tokenizer.decode_batch([ids], skip_special_tokens=False)[0]

    async def start(self) -> list[fanout.Choice]:
        return await fanout.submit(self.loop, self.prompts, self.options, self.body.choices)

    async def respond(self, client: HTTPRequest) -> dict[str, Any]:
        choices = await self.start()
        done = await fanout.results(choices, client)
        kept = self._best(done)
        firsts = done[:: self.body.choices]  # each prompt once
        prompt_tokens = sum(c.meta_info["prompt_tokens"] for c in firsts)
        # echo and logprobs decode text token by token: off the event loop
        out = await asyncio.to_thread(lambda: [self._choice(n, c) for n, c in enumerate(kept)])
        return self.head | {"choices": out,
                            "usage": usage(prompt_tokens, done, sum(c.meta_info["cached_tokens"] for c in firsts))}

    def _best(self, done: list[Completion]) -> list[Completion]:
        """best_of > n: per prompt, the n choices with the highest sum of the target's logprobs."""
        k, n = self.body.choices, self.body.n
        if k == n:
            return done
        out = []
        for p in range(len(self.prompts)):
            group = done[p * k:(p + 1) * k]
            out += sorted(group, key=lambda c: -sum(e.logprob for e in c.logprobs if e is not None))[:n]
        return out

    def _echo(self, req, log: Logprobs) -> str:
        """A streamed choice's prompt text, and its logprobs into ``log`` (a worker thread's job)."""
        if self.body.logprobs is not None:
            for k, tok in enumerate(req.prompt_ids):
                log.add(tok, req.logprobs.get(k) if k else None)
        return self.prompt_text(req.prompt_ids)

    def _choice(self, index: int, c: Completion) -> dict[str, Any]:
        text, lp = c.text, None
        if self.body.logprobs is not None:
            built = Logprobs(self.decode_one, self.body.logprobs)
            if self.body.echo:
                for tok, entry in zip(c.prompt_ids, c.prompt_logprobs or [None] * len(c.prompt_ids)):
                    built.add(tok, entry)
            for tok, entry in zip(c.output_ids, c.logprobs):
                built.add(tok, entry)
            lp = built.take()
        if self.body.echo:
            text = self.prompt_text(c.prompt_ids) + text
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason(c),
                "seed": c.meta_info["seed"]}

    async def stream(self):
        choices = await self.start()
        return sse(self._chunks(choices), choices)

    async def _chunks(self, choices: list[fanout.Choice]) -> AsyncIterator[dict[str, Any]]:
        body, opts = self.body, self.body.stream_options
        sent: dict[int, str] = {c.index: "" for c in choices}
        sent_ids: dict[int, int] = {c.index: 0 for c in choices}
        logs = {c.index: Logprobs(self.decode_one, body.logprobs) for c in choices}
        finished: list[Completion] = []
        prompts: dict[int, int] = {}
        async for choice, u in fanout.merged(choices):
            req, i = choice.handle.req, choice.index
            text = u.finished.text if u.finished else u.text
            delta, sent[i] = text[len(sent[i]):], text
            first = i not in prompts
            prompts[i] = len(req.prompt_ids)
            if body.echo and first:
                delta = await asyncio.to_thread(self._echo, req, logs[i]) + delta
            lp = None
            if body.logprobs is not None:
                for k, tok in enumerate(u.output_ids[sent_ids[i]:], len(req.prompt_ids) + sent_ids[i]):
                    logs[i].add(tok, req.logprobs.get(k))
                lp = logs[i].take()
            sent_ids[i] = len(u.output_ids)
            chunk = self.head | {"choices": [{"index": i, "text": delta, "logprobs": lp,
                                              "finish_reason": finish_reason(u.finished), "seed": req.params.seed}]}
            if u.finished is not None:
                finished.append(u.finished)
            if opts is not None and opts.include_usage:  # OpenAI: null on every chunk but the last
                chunk["usage"] = None
                if opts.continuous_usage_stats:  # vLLM's: this choice's usage so far
                    chunk["usage"] = {"prompt_tokens": prompts[i], "completion_tokens": sent_ids[i],
                                      "total_tokens": prompts[i] + sent_ids[i]}
            yield chunk
        if opts is not None and opts.include_usage:
            prompt_tokens = sum(n for i, n in prompts.items() if i % self.body.choices == 0)
            cached = sum(c.handle.req.cached_tokens for c in choices if c.index % self.body.choices == 0)
            yield self.head | {"choices": [], "usage": usage(prompt_tokens, finished, cached)}
