"""Generate text through steploop's gRPC Engine API directly (no HTTP): tokenize, stream token ids, detokenize.

    python examples/grpc_generate.py --scheduler-address 127.0.0.1:50051 "Once upon a time"

The model folder (for the tokenizer) defaults to the converted default model. It imports the installed steploop
package (`pip install .`, or the checkout's `.venv` from `make install`), as any client would.
"""

from __future__ import annotations

import argparse
import asyncio
import uuid

from steploop.client import EngineClient, EngineRequest, SamplingParams
from steploop.common.model_path import resolve_model
from steploop.gateway.text.tokenizer import load_tokenizer


async def generate(address: str, model: str | None, prompt: str, max_tokens: int, temperature: float) -> str:
    tokenizer = load_tokenizer(resolve_model(model))
    client = EngineClient(address)
    try:
        ids = tokenizer.encode_sync(prompt)
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0)
        out: list[int] = []
        async for chunk in client.generate(EngineRequest(f"example-{uuid.uuid4().hex}", ids, params)):
            out.extend(chunk.token_ids)
            print(tokenizer.decode(chunk.token_ids), end="", flush=True)
        print()
        return tokenizer.decode(out)
    finally:
        await client.close()
        tokenizer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--scheduler-address", default="127.0.0.1:50051")
    parser.add_argument("--model", default=None, help="model folder (for its tokenizer)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    asyncio.run(generate(args.scheduler_address, args.model, args.prompt, args.max_tokens, args.temperature))


if __name__ == "__main__":
    main()
