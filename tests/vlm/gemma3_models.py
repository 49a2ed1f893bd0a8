"""A random tiny Gemma 3 (SigLIP tower + Gemma 3 text decoder) built from transformers' own config classes (no
download), and the Gemma 3 image processor's output for a PNG as steploop's MultiModalFeature."""

from __future__ import annotations

import hashlib
import io
import pathlib

import numpy as np
import torch

IMAGE_SIZE, PATCH, TOKENS_PER_IMAGE = 32, 4, 16       # 8x8 patches, pooled 2x2 -> 4x4 = 16 image tokens
VOCAB = 512
BOI, IMAGE_TOKEN, EOI, NEWLINES = 500, 501, 502, 108  # <start_of_image>, <image_soft_token>, <end_of_image>, "\n\n"


def build_gemma3(folder: pathlib.Path, seed: int = 0, sliding_window: int = 8) -> pathlib.Path:
    """sliding_window smaller than an image's tokens: the image mask must reach past the window (transformers ORs
    it onto the sliding mask too)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor
    torch.manual_seed(seed)
    cfg = Gemma3Config(
        text_config={"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                     "max_position_embeddings": 1024, "sliding_window": sliding_window,
                     "layer_types": ["full_attention", "sliding_attention", "full_attention"],
                     "query_pre_attn_scalar": 16, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                     "initializer_range": 0.2, "eos_token_id": 1, "pad_token_id": 0, "bos_token_id": 2,
                     "tie_word_embeddings": False},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": IMAGE_SIZE, "patch_size": PATCH, "vision_use_head": False},
        mm_tokens_per_image=TOKENS_PER_IMAGE, boi_token_index=BOI, eoi_token_index=EOI,
        image_token_index=IMAGE_TOKEN, initializer_range=0.2, tie_word_embeddings=False, eos_token_id=1, pad_token_id=0, bos_token_id=2)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():       # a random init leaves the projection and norms at zero: give them values
        for name, p in model.named_parameters():
            if "norm" in name or "mm_input_projection" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(folder)
    return folder


def load_oracle(folder: pathlib.Path):
    from transformers import Gemma3ForConditionalGeneration
    return Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32,
                                                          attn_implementation="eager").eval()


def processed(png: bytes, folder: pathlib.Path) -> np.ndarray:
    """pixel_values [3, H, W] float32 from the model folder's Gemma 3 image processor."""
    from PIL import Image
    from transformers import Gemma3ImageProcessor
    proc = Gemma3ImageProcessor.from_pretrained(folder)
    out = proc(images=[Image.open(io.BytesIO(png)).convert("RGB")], return_tensors="np")
    return np.asarray(out["pixel_values"][0], dtype=np.float32)


def prompt_with_images(pngs: list[bytes], text_lens: list[int], folder: pathlib.Path, seed: int = 0):
    """Token ids: text, then per image "\\n\\n" <boi> <image>*16 <eoi> "\\n\\n" and text (Gemma3Processor's
    full_image_sequence), and the features; random text ids below the special tokens."""
    from steploop.common.mm_inputs import MultiModalFeature
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = [2] + torch.randint(10, 400, (text_lens[0],), generator=gen).tolist()
    features = []
    side = int(TOKENS_PER_IMAGE ** 0.5)
    for png, n_text in zip(pngs, text_lens[1:]):
        pixels = processed(png, folder)
        ids += [NEWLINES, BOI]
        features.append(MultiModalFeature(hashlib.sha256(png).hexdigest(), len(ids), TOKENS_PER_IMAGE,
                                          (1, side, side), pixels.shape, pixels.astype("<f4").tobytes()))
        ids += [IMAGE_TOKEN] * TOKENS_PER_IMAGE + [EOI, NEWLINES]
        ids += torch.randint(10, 400, (n_text,), generator=gen).tolist()
    return ids, features


def oracle_generate(model, ids: list[int], features, max_new_tokens: int) -> list[int]:
    """transformers' generate with the processor's token_type_ids (1 on image tokens: its bidirectional mask)."""
    input_ids = torch.tensor([ids])
    kwargs = {"token_type_ids": (input_ids == IMAGE_TOKEN).long()}
    if features:
        pixels = np.stack([np.frombuffer(f.pixel_values, "<f4").reshape(f.pixel_shape) for f in features])
        kwargs["pixel_values"] = torch.from_numpy(pixels.copy())
    with torch.no_grad():
        out = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones_like(input_ids), **kwargs)
    return out[0, len(ids):].tolist()


def png_bytes(width: int, height: int, seed: int) -> bytes:
    from PIL import Image
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()
