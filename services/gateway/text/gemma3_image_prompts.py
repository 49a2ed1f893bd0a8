"""Gemma 3's image prompts, as Gemma3Processor makes them: its chat template places <start_of_image> for each image
part, and the processor replaces that text with "\\n\\n<start_of_image>" + <image_soft_token> x mm_tokens_per_image
+ "<end_of_image>\\n\\n" before tokenizing the whole prompt. The replacement is textual (the newlines merge with
their neighbours, e.g. "user\\n" + "\\n\\n" is one "\\n\\n\\n" token), so the rendered prompt is decoded, replaced
and encoded again rather than spliced token by token. Pixels: Gemma3ImageProcessor, one [3, H, W] crop per image
(pan-and-scan crops are refused at start: their prompt text differs and is not implemented).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from steploop.common.mm_inputs import MultiModalFeature
from steploop.gateway.errors import bad_request
from steploop.gateway.media.decode import LoadedImage
from steploop.gateway.text.image_prompts import MAX_PIXEL_BYTES, ImagePrompts


class Gemma3ImagePrompts(ImagePrompts):
    def __init__(self, model_name: str, policy, processor: Any, tokenizer: Any, config: dict[str, Any]):
        super().__init__(model_name, policy, processor, int(config["boi_token_index"]))
        if getattr(processor, "do_pan_and_scan", False):
            raise ValueError("preprocessor_config.json sets do_pan_and_scan: Gemma 3's pan-and-scan crops are not "
                             "implemented; serve it with do_pan_and_scan false")
        self.tokenizer = tokenizer          # transformers' tokenizer of the model folder
        self.soft_token_id = int(config["image_token_index"])
        self.tokens_per_image = int(config.get("mm_tokens_per_image", 256))
        boi, soft, eoi = tokenizer.convert_ids_to_tokens([int(config["boi_token_index"]), self.soft_token_id,
                                                          int(config["eoi_token_index"])])
        self.boi_text = boi
        self.full_image_text = f"\n\n{boi}{soft * self.tokens_per_image}{eoi}\n\n"

    async def expand(self, prompt: list[int], images: list[LoadedImage],
                     param: str = "messages") -> tuple[list[int], list[MultiModalFeature]]:
        placed = sum(t == self.image_token_id for t in prompt)
        if placed != len(images):
            raise bad_request(f"the chat template placed {placed} image placeholders for {len(images)} images",
                              param=param)
        pixels = await asyncio.to_thread(lambda: [self._pixels(im) for im in images])
        size = sum(p.size * 4 for p in pixels)
        if size > MAX_PIXEL_BYTES:
            raise bad_request(f"the images of this request make {size >> 20} MiB of processed pixels, more than the "
                              f"{MAX_PIXEL_BYTES >> 20} MiB one request may carry; send smaller or fewer images",
                              param=param, code="image_too_large")
        text = self.tokenizer.decode(prompt, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        ids = self.tokenizer.encode(text.replace(self.boi_text, self.full_image_text), add_special_tokens=False)
        starts = [i for i, t in enumerate(ids) if t == self.soft_token_id and (i == 0 or ids[i - 1] != t)]
        if len(starts) != len(images) or sum(t == self.soft_token_id for t in ids) != len(images) * \
                self.tokens_per_image:
            raise bad_request("the prompt's text holds image tokens of its own; remove <image_soft_token> from it",
                              param=param)
        side = int(self.tokens_per_image ** 0.5)
        features = [MultiModalFeature(image.hash, at, self.tokens_per_image, (1, side, side), p.shape,
                                      p.astype("<f4").tobytes()) for at, image, p in zip(starts, images, pixels)]
        return ids, features

    def _pixels(self, image: LoadedImage) -> np.ndarray:
        """[3, H, W] float32: the processor's one crop of the image."""
        out = self.processor(images=[image.image], return_tensors="np")
        return np.asarray(out["pixel_values"][0], dtype=np.float32)
