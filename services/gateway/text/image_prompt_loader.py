"""The gateway's ImagePrompts for a model folder: the family's placeholder token (config.json) and the folder's own
image processor; a text-only model (or one without preprocessor_config.json) gets one that answers images with a
400. Gemma 3 expands its placeholder textually (gemma3_image_prompts.py)."""

from __future__ import annotations

import json
import pathlib

from steploop.gateway.media.policy import MediaPolicy
from steploop.gateway.text.gemma3_image_prompts import Gemma3ImagePrompts
from steploop.gateway.text.image_prompts import IMAGE_TOKEN_KEYS, ImagePrompts, image_processor


def load_image_prompts(folder: pathlib.Path, model_name: str, policy: MediaPolicy) -> ImagePrompts:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return ImagePrompts(model_name, policy)
    key = IMAGE_TOKEN_KEYS.get(config.get("model_type", ""))
    if key is None or not (folder / "preprocessor_config.json").is_file():
        return ImagePrompts(model_name, policy)
    processor = image_processor(folder)
    if config["model_type"] == "gemma3":      # its placeholder text is replaced before tokenizing
        from steploop.gateway.text.tokenizer import load_tokenizer
        return Gemma3ImagePrompts(model_name, policy, processor, load_tokenizer(folder).hf, config)
    return ImagePrompts(model_name, policy, processor, int(config[key]), int(getattr(processor, "merge_size", 1)))
