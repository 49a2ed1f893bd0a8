"""Shared helpers for the test_api_* integration tests: SDK clients and the reference logits."""

from __future__ import annotations

import functools

import openai

MODEL = "SmolLM2-135M-Instruct"


def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def aclient(cluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


@functools.lru_cache(maxsize=32)
def _log_softmax(hf, ids: tuple[int, ...]):
    torch = hf.torch
    with torch.no_grad():
        logits = hf.model(torch.tensor([list(ids)])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def reference_log_softmax(hf, ids):
    """[len(ids), vocab] fp32 log_softmax of transformers' logits at every position."""
    return _log_softmax(hf, tuple(ids))
