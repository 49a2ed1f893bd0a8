"""Images in a chat prompt: the model's own image processor prepares the pixels, and each image's one placeholder
token (put there by the chat template) is expanded to the number of embeddings its encoder yields.

The one internal form the three APIs share: a user message whose content holds images is a list of parts,
    {"type": "text", "text": str}    and    {"type": "image", "image": ImageRef}
in order (the form HuggingFace chat templates render: a part of type "image" becomes the model's image
placeholder, e.g. Qwen2.5-VL's <|vision_start|><|image_pad|><|vision_end|>). `images_of(messages)` gives the
ImageRefs in prompt order; `ImagePrompts.prepare` loads them (media/, under the MediaPolicy) and `expand` turns the
rendered prompt into (token ids, MultiModalFeature per image).

Transformers is imported with USE_TORCH=0 (text/tokenizer.py says why): the image processors used here are the
numpy ("slow") ones.
"""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from steploop.common.grpc_options import MAX_MESSAGE_BYTES
from steploop.common.mm_inputs import MultiModalFeature
from steploop.gateway.errors import bad_request
from steploop.gateway.media.decode import LoadedImage
from steploop.gateway.media.parts import ImageRef, load_images
from steploop.gateway.media.policy import MediaPolicy

# The processed pixels of one request travel to the scheduler and, in a step plan, to the worker (float32): at most
# a quarter of a gRPC message, so a plan still fits beside other new requests.
MAX_PIXEL_BYTES = MAX_MESSAGE_BYTES // 4

# model_type -> the config.json key of its image placeholder token id (the token its chat template places)
IMAGE_TOKEN_KEYS = {"qwen2_5_vl": "image_token_id", "gemma3": "boi_token_index"}


def images_of(messages: Sequence[dict[str, Any]]) -> list[ImageRef]:
    """The ImageRefs of every image part, in prompt order."""
    return [part["image"] for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if part.get("type") == "image"]


class ImagePrompts:
    def __init__(self, model_name: str, policy: MediaPolicy, processor: Any = None, image_token_id: int = -1,
                 merge_size: int = 1):
        """processor None: a text-only model (an image is a 400 saying so)."""
        self.model_name, self.policy, self.processor = model_name, policy, processor
        self.image_token_id, self.merge_size = image_token_id, merge_size
        self.on_images: Callable[[int], None] | None = None   # images per served request (gateway metrics.py)

    async def prepare(self, refs: list[ImageRef], served: bool = True) -> list[LoadedImage]:
        """served False: only counted (count_tokens), not in the images-per-request metric."""
        if not refs:
            return []
        if self.processor is None:
            raise bad_request(f"model {self.model_name!r} is a text-only model: it does not take images",
                              param=refs[0].param, code="invalid_value")
        images = await load_images(refs, self.policy)
        if served and self.on_images is not None:
            self.on_images(len(images))
        return images

    async def expand(self, prompt: list[int], images: list[LoadedImage],
                     param: str = "messages") -> tuple[list[int], list[MultiModalFeature]]:
        """Each placeholder token of the rendered prompt becomes its image's embeddings' worth of tokens."""
        at = [i for i, t in enumerate(prompt) if t == self.image_token_id]
        if len(at) != len(images):
            raise bad_request(f"the chat template placed {len(at)} image placeholders for {len(images)} images",
                              param=param)
        processed = await asyncio.to_thread(lambda: [self._process(im) for im in images])
        size = sum(pixels.size * 4 for pixels, _ in processed)
        if size > MAX_PIXEL_BYTES:
            raise bad_request(f"the images of this request make {size >> 20} MiB of processed pixels, more than the "
                              f"{MAX_PIXEL_BYTES >> 20} MiB one request may carry; send smaller or fewer images",
                              param=param, code="image_too_large")
        ids: list[int] = []
        features: list[MultiModalFeature] = []
        start = 0
        for pos, image, (pixels, grid) in zip(at, images, processed):
            ids += prompt[start:pos]
            n = grid[0] * grid[1] * grid[2] // (self.merge_size ** 2)
            features.append(MultiModalFeature(image.hash, len(ids), n, grid, pixels.shape,
                                              pixels.astype("<f4").tobytes()))
            ids += [self.image_token_id] * n
            start = pos + 1
        return ids + prompt[start:], features

    def _process(self, image: LoadedImage) -> tuple[np.ndarray, tuple[int, int, int]]:
        out = self.processor(images=[image.image], return_tensors="np")
        grid = tuple(int(v) for v in out["image_grid_thw"][0])
        return np.asarray(out["pixel_values"], dtype=np.float32), grid


def image_processor(folder: pathlib.Path) -> Any:
    from steploop.gateway.text.tokenizer import import_without_torch   # lazy: see the module docstring
    return import_without_torch("AutoImageProcessor").from_pretrained(str(folder), local_files_only=True,
                                                                      use_fast=False)
