"""Server-sent events: one `data:` line per chunk, then `[DONE]`; a client that leaves
mid-stream cancels its requests, which frees their slots at the next step."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Sequence

from fastapi.responses import StreamingResponse

from . import fanout


def sse(chunks: AsyncIterator[dict[str, Any]], choices: Sequence[fanout.Choice]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        done = False
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            done = True
            yield b"data: [DONE]\n\n"
        finally:
            if not done:
                fanout.cancel(choices, "cancelled: the client disconnected")

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
