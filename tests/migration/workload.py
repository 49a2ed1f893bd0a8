"""The acceptance workload: 16 HTTP requests of every kind migration must carry (streamed and not; greedy,
seeded, json_schema, n=2, logprobs, stop strings), each long enough to be mid-generation when its replica dies,
and what the client saw of each, reduced to what must not change: per choice the text, the finish reason, the
logprob tokens, plus the usage and how many times each terminal event came."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import aiohttp

from tests.integration.cluster import MODEL

LONG = {"max_tokens": 64, "ignore_eos": True}
LIST_SCHEMA = {"type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string",
               "maxLength": 10}, "minItems": 14, "maxItems": 14}}, "required": ["colours"]}
COUNT = "Count from 1 to 100, separated by commas: 1, 2, 3,"


def workload() -> list[tuple[str, dict]]:
    """(route, body) of the 16 requests; 18 engine requests (two ask for n=2)."""
    completions = [
        {"prompt": "Write a long story about a lighthouse keeper.", "stream": True, "temperature": 0, **LONG},
        {"prompt": "Explain how bread is made, step by step.", "stream": True, "temperature": 0, **LONG},
        {"prompt": "List the planets and describe each one.", "stream": True, "temperature": 0, **LONG},
        {"prompt": "Describe a walk through a forest in autumn.", "temperature": 0, **LONG},
        {"prompt": "Why is the sky blue? Answer at length.", "temperature": 0, **LONG},
        {"prompt": "A poem about the sea:", "stream": True, "temperature": 0.8, "top_p": 0.95, "seed": 11, **LONG},
        {"prompt": "A recipe for soup:", "stream": True, "temperature": 1.0, "top_k": 40, "seed": 12,
         "presence_penalty": 0.5, "frequency_penalty": 0.3, **LONG},
        {"prompt": "The history of trains:", "temperature": 0.7, "seed": 13, **LONG},
        {"prompt": "Ideas for a birthday party:", "stream": True, "n": 2, "temperature": 0.9, "seed": 21, **LONG},
        {"prompt": "How to learn to swim:", "stream": True, "n": 2, "temperature": 0.9, "seed": 22, **LONG},
        {"prompt": "The rules of chess are", "stream": True, "temperature": 0, "logprobs": 2, **LONG},
        {"prompt": "Tell me about volcanoes.", "stream": True, "temperature": 0.8, "seed": 31, "logprobs": 1, **LONG},
        {"prompt": COUNT, "stream": True, "temperature": 0, "stop": [", 20,", "one hundred"], **LONG},
        {"prompt": COUNT, "stream": True, "temperature": 0, "stop": [" 15, 16, 17"], "logprobs": 0, **LONG},
    ]
    chats = [{"messages": [{"role": "user", "content": f"Name fourteen colours as JSON ({i})."}], "stream": True,
              "temperature": 0 if i == 0 else 0.8, "seed": 40 + i, "max_tokens": 220,
              "response_format": {"type": "json_schema", "json_schema": {"name": "colours", "schema": LIST_SCHEMA}}}
             for i in range(2)]
    for body in completions + chats:
        body["model"] = MODEL
        if body.get("stream"):
            body["stream_options"] = {"include_usage": True}
    return [("/v1/completions", b) for b in completions] + [("/v1/chat/completions", b) for b in chats]


@dataclass
class Seen:
    """What one request's client saw. Streamed: `events` counts content events (to know it is mid-generation)."""
    choices: dict[int, dict] = field(default_factory=dict)
    usage: dict | None = None
    events: int = 0
    done: int = 0                       # [DONE] lines
    usage_events: int = 0
    errors: list = field(default_factory=list)

    def choice(self, index: int) -> dict:
        return self.choices.setdefault(index, {"text": "", "finish": [], "tokens": [], "logprobs": []})

    def add_choice(self, c: dict) -> None:
        mine = self.choice(c["index"])
        delta = c.get("delta")
        mine["text"] += (delta.get("content") or "") if delta is not None else c.get("text", "")
        if c.get("finish_reason"):
            mine["finish"].append(c["finish_reason"])
        lp = c.get("logprobs")
        if lp and "tokens" in lp:
            mine["tokens"] += lp["tokens"]
            mine["logprobs"] += lp["token_logprobs"]

    def normal(self) -> dict:
        """The comparable part: logprob values rounded (a re-prefill computes them on another path)."""
        usage = {k: self.usage[k] for k in ("prompt_tokens", "completion_tokens")} if self.usage else None
        return {"usage": usage, "done": self.done, "usage_events": self.usage_events, "errors": self.errors,
                "choices": {i: {**c, "logprobs": [round(x, 2) for x in c["logprobs"]]}
                            for i, c in sorted(self.choices.items())}}


async def run_one(http: aiohttp.ClientSession, base_url: str, route: str, body: dict, seen: Seen) -> None:
    async with http.post(base_url + route, json=body, timeout=aiohttp.ClientTimeout(total=900)) as resp:
        if not body.get("stream"):
            reply = await resp.json()
            if resp.status != 200:
                seen.errors.append(reply)
                return
            for c in reply["choices"]:
                seen.add_choice({**c, "text": c.get("text", (c.get("message") or {}).get("content", ""))})
            seen.usage = reply["usage"]
            return
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                seen.done += 1
                continue
            event = json.loads(line[6:])
            if "error" in event:
                seen.errors.append(event["error"])
                continue
            if event.get("usage"):
                seen.usage, seen.usage_events = event["usage"], seen.usage_events + 1
            for c in event["choices"]:
                seen.add_choice(c)
            seen.events += bool(event["choices"])


def start_all(base_url: str, http: aiohttp.ClientSession) -> tuple[list[Seen], list[asyncio.Task]]:
    seen = [Seen() for _ in workload()]
    tasks = [asyncio.create_task(run_one(http, base_url, route, body, s))
             for (route, body), s in zip(workload(), seen)]
    return seen, tasks


async def run_all(base_url: str) -> list[dict]:
    async with aiohttp.ClientSession() as http:
        seen, tasks = start_all(base_url, http)
        await asyncio.gather(*tasks)
    return [s.normal() for s in seen]
