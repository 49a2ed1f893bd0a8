"""The Python client of steploop's token-level gRPC API (the scheduler's Engine service).

It is the gateway's own EngineClient (services/gateway/engine/engine_client.py), exposed here so there is one client:

    from steploop.client import EngineClient, EngineRequest, SamplingParams

    async def main():
        client = EngineClient("127.0.0.1:50051")          # create it inside the running event loop
        params = SamplingParams(temperature=0.7, seed=1, max_tokens=32, logprobs=2)  # max_tokens None: what fits
        async for chunk in client.generate(EngineRequest("my-request-1", prompt_token_ids, params)):
            print(chunk.token_ids, chunk.finish_reason)         # EngineChunk; FinishReason.NONE until the last
        await client.abort(["some-other-request"])         # by id; closing the generate iterator aborts too
        info = await client.model_info()                   # ModelInfo: max_model_len, vocab_size, eos ids, KV pool
        load = await client.load_report()                  # LoadReport: queue lengths, free KV blocks
        await client.close()

Token ids in, token ids out: tokenize with the model folder's tokenizer (see examples/grpc_generate.py). The
types are the Engine seam's contract (services/common/engine_contract.py); protobuf stays inside the client.
Errors surface as steploop.gateway.errors.APIError with the HTTP status and OpenAI error code the gateway
would answer (400 invalid request, 503 overloaded or no worker, ...).
"""

from steploop.common.engine_contract import EngineChunk, EngineRequest, FinishReason, LoadReport, ModelInfo, Usage
from steploop.common.sampling_params import SamplingParams
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.errors import APIError

__all__ = ["APIError", "EngineChunk", "EngineClient", "EngineRequest", "FinishReason", "LoadReport", "ModelInfo",
           "SamplingParams", "Usage"]
