"""Server-sent events, as OpenAI streams them: `data: {json}\\n\\n` per chunk, then `data: [DONE]\\n\\n`.

Once the 200 and headers are out, an error can no longer change the status; it goes out as one
`data: {"error": ...}` event before [DONE], as vLLM and OpenAI do.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from services.gateway.errors import APIError, internal_error

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _event(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def stream_sse(request: web.Request, chunks: AsyncIterator[dict[str, Any]]) -> web.StreamResponse:
    """Writes chunks as they come. The first chunk is awaited before the 200 goes out, so errors that happen
    before any output (engine unavailable, invalid request at the engine) still get their real status."""
    # aclosing: however we leave (client gone, cancellation), the chunks' engine calls are cancelled now,
    # not whenever the garbage collector finalizes the generator.
    async with contextlib.aclosing(chunks):
        first = await anext(chunks, None)
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        try:
            if first is not None:
                await response.write(_event(first))
            async for chunk in chunks:
                await response.write(_event(chunk))
        except APIError as err:
            await response.write(_event(err.body()))
        except ConnectionError:
            raise   # the client went away; aclosing aborts the engine calls
        except Exception:
            logger.exception("stream failed")
            await response.write(_event(internal_error().body()))
    await response.write(_event("[DONE]"))
    await response.write_eof()
    return response
