"""The /v1/embeddings response shaper: OpenAI's `{"object": "list", "data": [...], "model", "usage"}`."""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Sequence
from typing import Any


def encode(vector: Sequence[float], encoding_format: str) -> list[float] | str:
    """float: the list; base64: the little-endian float32 bytes, base64-encoded (what OpenAI sends)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return list(vector)


def embeddings_body(request_id: str, model: str, vectors: Sequence[Sequence[float]], prompt_tokens: int,
                    encoding_format: str) -> dict[str, Any]:
    return {
        "id": request_id, "object": "list", "created": int(time.time()), "model": model,
        "data": [{"object": "embedding", "index": i, "embedding": encode(vec, encoding_format)}
                 for i, vec in enumerate(vectors)],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
