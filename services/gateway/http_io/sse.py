"""Server-sent events, as OpenAI streams them: `data: {json}\\n\\n` per chunk, then `data: [DONE]\\n\\n`; and
as Anthropic's Messages and OpenAI's Responses stream them: `event: {type}\\ndata: {json}\\n\\n`, no [DONE].

Once the 200 and headers are out, an error can no longer change the status; it goes out as one error event
(OpenAI: `data: {"error": ...}` before [DONE], as vLLM and OpenAI do; Anthropic: an `error` event). A stream the
drain deadline cuts (drain.py) ends the same way, with a `shutting_down` error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from steploop.gateway.drain import cut_by_drain
from steploop.gateway.errors import APIError, internal_error

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _event(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _typed_event(payload: dict[str, Any]) -> bytes:
    return f"event: {payload['type']}\n".encode() + _event(payload)


async def stream_sse(request: web.Request, chunks: AsyncIterator[dict[str, Any]]) -> web.StreamResponse:
    """OpenAI's form; see _stream."""
    return await _stream(request, chunks, _event, lambda err: _event(err.body()), _event("[DONE]"))


async def stream_typed_sse(request: web.Request, chunks: AsyncIterator[dict[str, Any]],
                           error_event: Callable[[APIError], dict[str, Any]]) -> web.StreamResponse:
    """Each chunk names its event in its "type" (Anthropic's and Responses' form); an error is `error_event(err)`."""
    return await _stream(request, chunks, _typed_event, lambda err: _typed_event(error_event(err)), b"")


async def _stream(request: web.Request, chunks: AsyncIterator[dict[str, Any]], encode: Callable[[Any], bytes],
                  encode_error: Callable[[APIError], bytes], trailer: bytes) -> web.StreamResponse:
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
                await response.write(encode(first))
            async for chunk in chunks:
                await response.write(encode(chunk))
        except APIError as err:
            await response.write(encode_error(err))
        except ConnectionError:
            raise   # the client went away; aclosing aborts the engine calls
        except asyncio.CancelledError:
            error = cut_by_drain()
            if error is None:
                raise   # the client went away (handler cancellation) or the server is being killed
            await response.write(encode_error(error))
        except Exception:
            logger.exception("stream failed")
            await response.write(encode_error(internal_error()))
    if trailer:
        await response.write(trailer)
    await response.write_eof()
    return response
