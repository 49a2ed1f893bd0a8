"""A random tiny Qwen2.5-VL built from transformers' own config class (no download), generated PNG images, and
the processor's output for them as steploop's MultiModalFeature."""

from __future__ import annotations

import hashlib
import io
import pathlib

import numpy as np
import torch

IMAGE_TOKEN, VISION_START, VISION_END = 151655, 151652, 151653
VOCAB = 151700


# A Qwen-style chat template: an image part becomes <|vision_start|><|image_pad|><|vision_end|>.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n"
    "{%- if m['content'] is string -%}{{ m['content'] }}{%- else -%}{%- for p in m['content'] -%}"
    "{%- if p['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif p['type'] == 'text' -%}{{ p['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}<|im_end|>\n"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")


def build_qwen2_5_vl(folder: pathlib.Path, seed: int = 0, tokenizer_dir: pathlib.Path | None = None,
                     text: dict | None = None, vision: dict | None = None) -> pathlib.Path:
    """tokenizer_dir (the default model's): the folder also gets that tokenizer with the three vision tokens
    added, this chat template and the Qwen2-VL image processor's config, so the gateway can serve it. text /
    vision: config values over the tiny ones (benchmarks size the model with them)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    ids = {"vocab": VOCAB, "image": IMAGE_TOKEN, "start": VISION_START, "end": VISION_END, "eos": 151645}
    if tokenizer_dir is not None:
        ids = _save_tokenizer(folder, tokenizer_dir)
    torch.manual_seed(seed)
    cfg = Qwen2_5_VLConfig(
        text_config={"vocab_size": ids["vocab"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
                         "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}, "rope_theta": 1e6,
                         "initializer_range": 0.2, "tie_word_embeddings": False, "eos_token_id": ids["eos"],
                         **(text or {})},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                           "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                           "fullatt_block_indexes": [1], "initializer_range": 0.2,
                           **({"out_hidden_size": text["hidden_size"]} if text and "hidden_size" in text else {}),
                           **(vision or {})},
        image_token_id=ids["image"], video_token_id=ids["image"] + 10, vision_start_token_id=ids["start"],
        vision_end_token_id=ids["end"], eos_token_id=ids["eos"])
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    model.save_pretrained(folder)
    return folder


def _save_tokenizer(folder: pathlib.Path, tokenizer_dir: pathlib.Path) -> dict[str, int]:
    from transformers import AutoTokenizer, Qwen2VLImageProcessor
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    Qwen2VLImageProcessor().save_pretrained(folder)
    start, image, end = tok.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    return {"vocab": len(tok) + 40, "image": image, "start": start, "end": end, "eos": tok.eos_token_id}


def load_oracle(folder: pathlib.Path):
    from transformers import Qwen2_5_VLForConditionalGeneration
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def png_bytes(width: int, height: int, seed: int) -> bytes:
    from PIL import Image
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def processed(png: bytes) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(pixel_values [patches, dim] float32, grid_thw) from transformers' Qwen2-VL image processor."""
    from PIL import Image
    from transformers import Qwen2VLImageProcessor
    out = Qwen2VLImageProcessor()(images=[Image.open(io.BytesIO(png)).convert("RGB")], return_tensors="np")
    return np.asarray(out["pixel_values"], dtype=np.float32), tuple(int(v) for v in out["image_grid_thw"][0])


def prompt_with_images(pngs: list[bytes], text_lens: list[int], seed: int = 0):
    """Token ids text, <vision_start> <image_pad>*n <vision_end>, text, ... (len(text_lens) == len(pngs) + 1) and
    the features; random text ids below the special tokens."""
    from steploop.common.mm_inputs import MultiModalFeature
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = torch.randint(10, 150000, (text_lens[0],), generator=gen).tolist()
    features = []
    for png, n_text in zip(pngs, text_lens[1:]):
        pixels, grid = processed(png)
        n = grid[0] * grid[1] * grid[2] // 4
        ids.append(VISION_START)
        features.append(MultiModalFeature(hashlib.sha256(png).hexdigest(), len(ids), n, grid, pixels.shape,
                                          pixels.astype("<f4").tobytes()))
        ids += [IMAGE_TOKEN] * n + [VISION_END]
        ids += torch.randint(10, 150000, (n_text,), generator=gen).tolist()
    return ids, features


def oracle_generate(model, ids: list[int], features, max_new_tokens: int) -> list[int]:
    kwargs = {}
    if features:
        pixels = np.concatenate([np.frombuffer(f.pixel_values, "<f4").reshape(f.pixel_shape) for f in features])
        kwargs = {"pixel_values": torch.from_numpy(pixels.copy()),
                  "image_grid_thw": torch.tensor([list(f.grid_thw) for f in features])}
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0, **kwargs)
    return out[0, len(ids):].tolist()
