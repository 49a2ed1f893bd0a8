"""The model's generation_config.json as vLLM's `--generation-config` reads it: sampling defaults and EOS ids.

    auto   (default) the model folder's generation_config.json (or, without one, the generation fields of its
           config.json, as transformers' GenerationConfig.from_model_config derives them)
    vllm   no sampling defaults (the API's own); EOS ids still come from the model folder
    FOLDER a folder holding a generation_config.json, read instead of the model's

As vLLM (ModelConfig.get_diff_sampling_param), only the fields that differ from transformers' GenerationConfig()
defaults count (to_diff_dict: a file's top_k 50 or temperature 1.0 is transformers' default, so not taken), and of
those only temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as max_tokens).
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

from steploop.common.generation_defaults import NO_DEFAULTS, GenerationDefaults

log = logging.getLogger(__name__)

MODES = ("auto", "vllm")
_TAKEN = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float,
          "max_new_tokens": int}


def _source(mode: str, model_path: pathlib.Path) -> pathlib.Path:
    if mode in MODES:
        return model_path
    folder = pathlib.Path(mode)
    if not (folder / "generation_config.json").is_file():
        raise ValueError(f"--generation-config {mode!r} must be auto, vllm or a folder holding a "
                         f"generation_config.json")
    return folder


def _diff_dict(folder: pathlib.Path) -> dict[str, Any]:
    """The generation config's fields that differ from transformers' defaults ({} when there is none)."""
    from transformers import AutoConfig, GenerationConfig
    try:
        config = GenerationConfig.from_pretrained(str(folder))
    except OSError:                      # no generation_config.json: what config.json implies (as vLLM)
        try:
            config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(folder)))
        except (OSError, ValueError):
            return {}
    return config.to_diff_dict()


def read_generation_defaults(mode: str, model_path: pathlib.Path) -> GenerationDefaults:
    """The sampling defaults --generation-config gives; logs, as vLLM does, when the model's override the API's."""
    if mode == "vllm":
        return NO_DEFAULTS
    diff = _diff_dict(_source(mode, model_path))
    taken = {key: cast(diff[key]) for key, cast in _TAKEN.items() if diff.get(key) is not None}
    if "max_new_tokens" in taken:        # transformers' max_new_tokens is vLLM's max_tokens
        taken["max_tokens"] = taken.pop("max_new_tokens")
    defaults = GenerationDefaults(**taken)
    if taken:
        log.warning("Default sampling parameters have been overridden by the model's Hugging Face generation "
                    "config recommended from the model creator: %s. If this is not intended, relaunch with "
                    "`--generation-config vllm`.", defaults.overridden())
    return defaults


def generation_eos_ids(mode: str, model_path: pathlib.Path, model_eos: tuple[int, ...]) -> tuple[int, ...]:
    """EOS ids: a --generation-config folder's eos_token_id wins over the model's (which already prefers the
    model folder's generation_config.json over config.json)."""
    if mode in MODES:
        return model_eos
    eos = _diff_dict(_source(mode, model_path)).get("eos_token_id")
    if eos is None:
        return model_eos
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)
