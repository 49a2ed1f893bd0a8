"""The /v1/embeddings handler: parse, check the model serves embeddings (a --runner pooling worker) and the
`dimensions` it allows, tokenize, run every input as one engine request (all at once: the scheduler batches them
like prompt chunks, and inputs sharing a prefix share the prefix cache when the pooling allows), shape."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Sequence

from aiohttp import web

from steploop.common.engine_contract import EngineRequest, FinishReason
from steploop.common.pooling_params import PoolingParams
from steploop.common.sampling_params import SamplingParams
from steploop.gateway import request_class
from steploop.gateway.app_keys import SERVING
from steploop.gateway.embeddings_api.outputs import embeddings_body
from steploop.gateway.embeddings_api.protocol import parse_embeddings
from steploop.gateway.errors import APIError, bad_request
from steploop.gateway.http_io.request_body import read_json
from steploop.gateway.serving import Serving


def _too_long(max_model_len: int, n: int, index: int) -> APIError:
    return bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                       f"{n} tokens in the input for embedding generation (input {index}). Please reduce the "
                       "length of the input.", param="input", code="context_length_exceeded")


async def _embed_one(serving: Serving, request_id: str, prompt_ids: Sequence[int],
                     pooling: PoolingParams) -> tuple[list[float], int]:
    """(vector, prompt tokens) of one input; engine errors about the prompt name `input`."""
    stream = serving.engine.generate(EngineRequest(request_id, list(prompt_ids), SamplingParams(), pooling=pooling,
                                                   background=request_class.is_background()))
    try:
        async with contextlib.aclosing(stream):   # leaving early (an error, a client gone) aborts the request
            async for chunk in stream:
                if chunk.finish_reason == FinishReason.ERROR:
                    raise APIError(500, f"embedding failed: {chunk.error_message or 'engine error'}",
                                   type="server_error", code="engine_error")
                if chunk.finished and chunk.embedding:
                    return list(chunk.embedding), chunk.usage.prompt_tokens if chunk.usage else len(prompt_ids)
                if chunk.finished:
                    break
    except APIError as err:
        if err.param == "prompt":
            err.param = "input"
        raise
    raise APIError(500, "the engine ended the embedding request without a vector", type="server_error",
                   code="engine_error")


async def create(request: web.Request) -> web.Response:
    serving = request.app[SERVING]
    model = serving.model
    req = parse_embeddings(await read_json(request), model.vocab_size or None)
    if serving.check_model(req.model):       # a LoRA adapter's name: adapters serve generation only
        raise bad_request(f"The model '{req.model}' is a LoRA adapter; embeddings use the base model",
                          param="model", code="model_not_supported")
    await serving.gate.wait_open()
    await model.check_serves("pooling", "Embeddings")
    if req.dimensions is not None and model.pooling is not None:
        try:
            model.pooling.check_dimensions(req.dimensions, model.served_model_name)
        except ValueError as exc:
            raise bad_request(str(exc), param="dimensions") from exc
    prompts = [p if isinstance(p, tuple) else tuple(await serving.tokenizer.encode(p)) for p in req.inputs]
    for index, ids in enumerate(prompts):
        if model.max_model_len and len(ids) > model.max_model_len:
            raise _too_long(model.max_model_len, len(ids), index)
    request_id = f"embd-{uuid.uuid4().hex}"
    pooling = PoolingParams(req.dimensions)
    tasks = [asyncio.ensure_future(_embed_one(serving, f"{request_id}-{i}", ids, pooling))
             for i, ids in enumerate(prompts)]
    try:
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:                        # one failed (or the client left): the others are aborted
            task.cancel()
    return web.json_response(embeddings_body(request_id, model.served_model_name, [vec for vec, _ in results],
                                             sum(n for _, n in results), req.encoding_format))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", create)
