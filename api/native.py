"""SGLang's native /generate: a prompt or a batch of them, n choices, the target's logprobs in
SGLang's meta_info fields (``[logprob, token_id, None]`` triples)."""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import Request as HTTPRequest

from draftline.core.engine import Completion
from draftline.core.logprobs import TokenLogprob
from draftline.core.loop import EngineLoop

from . import fanout
from .limits import Limits
from .schemas import GenerateRequest
from .stream import sse


def _triple(entry: TokenLogprob | None, token: int) -> list[Any]:
    return [None if entry is None else entry.logprob, token, None]


def _tops(entry: TokenLogprob | None) -> list[list[Any]] | None:
    return None if entry is None else [[lp, t, None] for t, lp in entry.top]


class GenerateRoute:
    def __init__(self, loop: EngineLoop, body: GenerateRequest, limits: Limits):
        sp = body.sampling_params
        limits.prompts(body.prompts, "text" if body.text is not None else "input_ids")
        limits.stop(sp.stop, "sampling_params.stop")
        limits.logit_bias(sp.logit_bias, "sampling_params.logit_bias")
        limits.choices(sp.n, None, len(body.prompts), "sampling_params.n")
        self.loop, self.body = loop, body
        self.options = body.options(loop.engine.spec.sampling)

    async def start(self) -> list[fanout.Choice]:
        return await fanout.submit(self.loop, self.body.prompts, self.options, self.body.sampling_params.n,
                                   self.body.speculative)

    def _many(self) -> bool:
        return self.body.batched or self.body.sampling_params.n > 1

    def result(self, c: Completion, index: int) -> dict[str, Any]:
        meta = dict(c.meta_info)
        if self.body.rid is not None:
            meta["rid"] = self.body.rid
        if self.body.return_logprob:
            meta |= self._logprobs(c)
        out = {"text": c.text, "output_ids": c.output_ids, "meta_info": meta}
        return out | ({"index": index} if self._many() else {})

    def _logprobs(self, c: Completion) -> dict[str, Any]:
        out_lp = c.logprobs or []
        meta: dict[str, Any] = {"output_token_logprobs": [_triple(e, t) for t, e in zip(c.output_ids, out_lp)]}
        if self.body.top_logprobs_num:
            meta["output_top_logprobs"] = [_tops(e) for e in out_lp]
        start = self.body.logprob_start_len
        if start >= 0 and c.prompt_logprobs is not None:
            ids, lps = c.prompt_ids[start:], c.prompt_logprobs[start:]
            meta["input_token_logprobs"] = [_triple(e, t) for t, e in zip(ids, lps)]
            if self.body.top_logprobs_num:
                meta["input_top_logprobs"] = [_tops(e) for e in lps]
        return meta

    async def respond(self, client: HTTPRequest) -> dict[str, Any] | list[dict[str, Any]]:
        choices = await self.start()
        done = await fanout.results(choices, client)
        out = [self.result(c, ch.index) for ch, c in zip(choices, done)]
        return out if self._many() else out[0]

    async def stream(self):
        choices = await self.start()
        return sse(self._chunks(choices), choices)

    async def _chunks(self, choices: list[fanout.Choice]) -> AsyncIterator[dict[str, Any]]:
        async for choice, u in fanout.merged(choices):
            if u.finished is not None:
                yield self.result(u.finished, choice.index)
                continue
            meta = {"id": str(choice.handle.req.rid), "finish_reason": None, "completion_tokens": len(u.output_ids)}
            yield {"text": u.text, "output_ids": u.output_ids, "meta_info": meta} | (
                {"index": choice.index} if self._many() else {})
