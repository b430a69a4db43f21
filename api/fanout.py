"""One API request, many engine requests: prompts x choices, each choice's seed, their results
and their updates merged into one stream."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from draftline.core.engine import Completion
from draftline.core.loop import EngineLoop, Handle, Update
from draftline.core.options import SamplingOptions, nth_seed


@dataclass(frozen=True)
class Choice:
    index: int  # prompt * n + j, as OpenAI numbers choices of list prompts
    prompt: int  # which of the request's prompts
    handle: Handle


def submit(loop: EngineLoop, prompts: Sequence[str | list[int]], options: SamplingOptions, n: int,
           speculate: bool = True) -> list[Choice]:
    """Queue ``n`` choices per prompt. A seeded request's j-th choice uses seed + j (so choices
    differ and replay); an unseeded one draws a fresh seed per choice. If any is refused, the
    ones already queued are cancelled and the error propagates (one answer per request)."""
    choices: list[Choice] = []
    try:
        for p, prompt in enumerate(prompts):
            for j in range(n):
                params = options.params(seed=None if options.seed is None else nth_seed(options.seed, j))
                choices.append(Choice(p * n + j, p, loop.submit(prompt, params, speculate)))
    except BaseException:
        cancel(choices)
        raise
    return choices


def cancel(choices: Sequence[Choice]) -> None:
    for c in choices:
        c.handle.cancel()


async def results(choices: Sequence[Choice]) -> list[Completion]:
    return list(await asyncio.gather(*(c.handle.result() for c in choices)))


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
