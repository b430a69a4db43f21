"""One API request, many engine requests: prompts x choices, each choice's seed, their results
and their updates merged into one stream. Prompts are tokenized in a worker thread (the event
loop serves the other clients meanwhile), and a client that leaves before its answer is ready
cancels its requests, streaming or not."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from fastapi import Request as HTTPRequest

from draftline.core.engine import Completion
from draftline.core.loop import EngineLoop, Handle, Update
from draftline.core.options import SamplingOptions, nth_seed
from draftline.core.request import Request

from .errors import ClientGone


@dataclass(frozen=True)
class Choice:
    index: int  # prompt * n + j, as OpenAI numbers choices of list prompts
    prompt: int  # which of the request's prompts
    handle: Handle


async def submit(loop: EngineLoop, prompts: Sequence[str | list[int]], options: SamplingOptions, n: int,
                 speculate: bool = True) -> list[Choice]:
    """Queue ``n`` choices per prompt, all or none (the first refusal is the request's answer).
    A seeded request's j-th choice uses seed + j (so choices differ and replay); an unseeded
    one draws a fresh seed per choice."""
    reqs = await asyncio.to_thread(_prepare, loop, prompts, options, n, speculate)
    return [Choice(i, i // n, h) for i, h in enumerate(loop.enqueue(reqs))]


def _prepare(loop: EngineLoop, prompts: Sequence[str | list[int]], options: SamplingOptions, n: int,
             speculate: bool) -> list[Request]:
    """Every choice's engine request; each prompt is tokenized once, for its first choice."""
    out: list[Request] = []
    for prompt in prompts:
        for j in range(n):
            params = options.params(seed=None if options.seed is None else nth_seed(options.seed, j))
            out.append(loop.prepare(out[-1].prompt_ids if j else prompt, params, speculate))
    return out


def cancel(choices: Sequence[Choice], reason: str = "cancelled") -> None:
    for c in choices:
        c.handle.cancel(reason)


async def results(choices: Sequence[Choice], client: HTTPRequest | None = None) -> list[Completion]:
    """Every choice's completion; if ``client`` disconnects first, its requests are cancelled
    (their slots free at the engine's next step) and ClientGone is raised."""
    work = asyncio.ensure_future(asyncio.gather(*(c.handle.result() for c in choices)))
    if client is None:
        return list(await work)
    gone = asyncio.ensure_future(_disconnect(client))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not work.done():
        cancel(choices, "cancelled: the client disconnected")
        work.cancel()
        raise ClientGone()
    return list(work.result())


async def _disconnect(client: HTTPRequest) -> None:
    """Returns when the client's connection closes (its body is read by now: the next message
    the server sends is the disconnect)."""
    while (await client.receive())["type"] != "http.disconnect":
        pass


async def merged(choices: Sequence[Choice]) -> AsyncIterator[tuple[Choice, Update]]:
    """Every choice's updates as they come, until each has finished."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        async for update in choice.handle.updates():
            await queue.put((choice, update))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    left = len(choices)
    try:
        while left:
            choice, update = await queue.get()
            left -= update.finished is not None
            yield choice, update
    finally:
        for t in tasks:
            t.cancel()
