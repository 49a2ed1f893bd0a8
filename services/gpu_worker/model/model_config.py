"""The few config.json fields the Llama-family forward needs, read straight from a HuggingFace folder."""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral")


@dataclass(frozen=True)
class LlamaModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_dir(cls, path: pathlib.Path) -> LlamaModelConfig:
        raw = json.loads((path / "config.json").read_text())
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{path}: model_type {model_type!r} is not supported; "
                             f"steploop runs {', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family) models")
        heads = raw["num_attention_heads"]
        return cls(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=raw.get("rope_theta", 10000.0),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", False), mlp_bias=raw.get("mlp_bias", False),
            rope_scaling=raw.get("rope_scaling"), eos_token_ids=_eos_ids(path, raw))


def _eos_ids(path: pathlib.Path, raw: dict[str, Any]) -> tuple[int, ...]:
    """EOS ids: generation_config.json wins over config.json (as in transformers)."""
    eos = raw.get("eos_token_id")
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
