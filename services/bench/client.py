"""One streamed request to an OpenAI-compatible server over aiohttp, timed per chunk.

Plain aiohttp instead of the openai SDK: the SDK's parsing costs client CPU that would count against the server.
Token counts come from the server's usage (stream_options.include_usage); without it, from the tokenizer.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import aiohttp

from steploop.bench.datasets import SampleRequest
from steploop.bench.metrics import RequestResult, distribute_tokens, spread_itl


@dataclass(frozen=True)
class Target:
    base_url: str                        # http://host:port
    model: str
    endpoint: str = "/v1/completions"    # or /v1/chat/completions
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0

    @property
    def is_chat(self) -> bool:
        return "chat" in self.endpoint


def build_payload(target: Target, req: SampleRequest) -> dict:
    body = {"model": target.model, "stream": True, "stream_options": {"include_usage": True},
            "temperature": target.temperature}
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.is_chat:
        prompt = req.prompt if isinstance(req.prompt, str) else " ".join(map(str, req.prompt))
        body.update(messages=[{"role": "user", "content": prompt}], max_completion_tokens=req.output_len,
                    max_tokens=req.output_len)
    else:
        body.update(prompt=req.prompt, max_tokens=req.output_len)
    return body


def _chunk_text(target: Target, chunk: dict) -> str | None:
    """The output text a chunk carries, or None for chunks without choices (usage) or role-only deltas."""
    choices = chunk.get("choices") or []
    if not choices:
        return None
    if target.is_chat:
        text = (choices[0].get("delta") or {}).get("content")
    else:
        text = choices[0].get("text")
    return text or None


async def send_request(session: aiohttp.ClientSession, target: Target, req: SampleRequest,
                       tokenizer=None) -> RequestResult:
    result = RequestResult(prompt_len=req.prompt_len)
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    times: list[float] = []
    texts: list[str] = []
    usage = None
    start = result.start_time = time.perf_counter()
    try:
        async with session.post(target.base_url.rstrip("/") + target.endpoint, json=build_payload(target, req),
                                headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return result
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                text = _chunk_text(target, chunk)
                if text is not None:
                    times.append(time.perf_counter())
                    texts.append(text)
        result.latency = time.perf_counter() - start
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if not times:
        result.error = "no output chunk"
        return result
    result.generated_text = "".join(texts)
    result.ttft = times[0] - start
    weights = [len(tokenizer.encode(t, add_special_tokens=False)) for t in texts] if tokenizer else [1] * len(texts)
    if usage and usage.get("completion_tokens"):
        result.output_tokens = int(usage["completion_tokens"])
        result.prompt_len = int(usage.get("prompt_tokens") or req.prompt_len)
    else:
        result.output_tokens = sum(weights) if tokenizer else len(texts)
    per_chunk = distribute_tokens(weights, result.output_tokens)
    result.itl = spread_itl(times, per_chunk)
    result.success = True
    return result
