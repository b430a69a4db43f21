"""OpenAI's /v1/chat/completions: messages rendered with the checkpoint's chat template, the
same sampling fields as completions, logprobs in the chat shape, streaming chunks; each
choice carries the ``seed`` it was sampled with (as completions' choices do)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request as HTTPRequest

from draftline.core.engine import Completion, RequestError
from draftline.core.logprobs import TokenLogprob
from draftline.core.loop import EngineLoop
from draftline.core.models.chat_template import ChatTemplateError

from . import fanout
from .completions import check_sampling, finish_reason, refuse_unimplemented, usage
from .limits import Limits
from .schemas import ChatRequest
from .stream import sse
from .tools import ToolPlan, ToolStream


def _finish(c: Completion, called: bool) -> str | None:
    """OpenAI's finish reason: ``tool_calls`` where a turn that ended by itself made calls."""
    reason = finish_reason(c)
    return "tool_calls" if called and reason == "stop" else reason


class ChatRoute:
    def __init__(self, loop: EngineLoop, body: ChatRequest, model: str, limits: Limits):
        refuse_unimplemented(body)
        self.messages = [m.for_template() for m in body.messages]
        limits.chat([m["content"] for m in self.messages if isinstance(m.get("content"), str)])
        check_sampling(body, limits)
        limits.choices(body.n, None, 1)
        self.template = loop.engine.chat_template
        if self.template is None:
            raise RequestError("this checkpoint has no chat template (tokenizer_config.json `chat_template`); "
                               "use /v1/completions, or add a template to the checkpoint folder", "messages")
        self.loop, self.body, self.limits = loop, body, limits
        self.tokenizer = loop.engine.tokenizer
        self.plan = body.tool_plan()
        self.options = body.options(loop.engine.spec.sampling)
        self.head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": body.model or model}

    def _render(self) -> str:
        try:
            tools = {} if self.plan is None else {"tools": list(self.plan.tools)}
            return self.template.render(self.messages, **(self.body.template_kwargs() | tools))
        except ChatTemplateError as exc:
            raise RequestError(str(exc), "messages") from None

    async def start(self) -> list[fanout.Choice]:
        prompt = await asyncio.to_thread(self._render)  # a template over long messages takes a while
        self.limits.prompts([prompt], "messages")
        return await fanout.submit(self.loop, [prompt], self.options, self.body.n)

    def _entry(self, token: int, e: TokenLogprob | None) -> dict[str, Any]:
        def one(t: int, lp: float | None) -> dict[str, Any]:
            text = self.tokenizer.decode([t], skip_special_tokens=False)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        out = one(token, None if e is None else e.logprob)
        return out | {"top_logprobs": [] if e is None else [one(t, lp) for t, lp in e.top[: self.body.top_logprobs or 0]]}

    def _logprobs(self, ids: list[int], entries: list[TokenLogprob | None]) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None
        return {"content": [self._entry(t, e) for t, e in zip(ids, entries)]}

    async def respond(self, client: HTTPRequest) -> dict[str, Any]:
        choices = await self.start()
        done = await fanout.results(choices, client)
        logprobs = await asyncio.to_thread(lambda: [self._logprobs(c.output_ids, c.logprobs or []) for c in done])
        out = [{"index": ch.index, **self._message(c), "logprobs": lp, "seed": c.meta_info["seed"]}
               for ch, c, lp in zip(choices, done, logprobs)]
        return self.head | {"object": "chat.completion", "choices": out,
                            "usage": usage(done[0].meta_info["prompt_tokens"], done, done[0].meta_info["cached_tokens"])}

    def _message(self, c: Completion) -> dict[str, Any]:
        """The assistant message and finish reason of a finished choice (its calls parsed)."""
        content, calls = (c.text, []) if self.plan is None else self.plan.parse(c.text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.to_dict() for call in calls]
        return {"message": message, "finish_reason": _finish(c, bool(calls))}

    async def stream(self):
        choices = await self.start()
        return sse(self._chunks(choices), choices)

    def _chunk(self, choice: fanout.Choice, delta: dict[str, Any], lp: Any = None, finish: str | None = None,
               made: tuple[int, int] | None = None) -> dict[str, Any]:
        chunk = self.head | {"object": "chat.completion.chunk",
                             "choices": [{"index": choice.index, "delta": delta, "logprobs": lp, "finish_reason": finish,
                                          "seed": choice.handle.req.params.seed}]}
        opts = self.body.stream_options
        if opts is None or not opts.include_usage:
            return chunk
        if opts.continuous_usage_stats and made is not None:  # vLLM's: this choice's usage so far
            return chunk | {"usage": {"prompt_tokens": made[0], "completion_tokens": made[1], "total_tokens": sum(made)}}
        return chunk | {"usage": None}

    async def _chunks(self, choices: list[fanout.Choice]) -> AsyncIterator[dict[str, Any]]:
        for c in choices:  # OpenAI opens each choice with the role
            yield self._chunk(c, {"role": "assistant", "content": ""})
        sent_ids = {c.index: 0 for c in choices}
        tools = {c.index: ToolStream(self.plan or ToolPlan((), "none")) for c in choices}
        finished: list[Completion] = []
        async for choice, u in fanout.merged(choices):
            req, i = choice.handle.req, choice.index
            text = u.finished.text if u.finished else u.text
            new = u.output_ids[sent_ids[i]:]
            first = len(req.prompt_ids) + sent_ids[i]
            lp = self._logprobs(new, [req.logprobs.get(first + k) for k in range(len(new))])
            sent_ids[i] = len(u.output_ids)
            made = (len(req.prompt_ids), sent_ids[i])
            deltas, called = tools[i].finish(text) if u.finished else (tools[i].feed(text), False)
            for k, delta in enumerate(deltas or ([{"content": ""}] if lp else [])):
                yield self._chunk(choice, delta, lp if k == 0 else None, made=made)
            if u.finished is not None:
                finished.append(u.finished)
                yield self._chunk(choice, {}, None, _finish(u.finished, called), made)
        if self.body.include_usage():
            yield self.head | {"object": "chat.completion.chunk", "choices": [],
                               "usage": usage(finished[0].meta_info["prompt_tokens"], finished,
                                              finished[0].meta_info["cached_tokens"])}
