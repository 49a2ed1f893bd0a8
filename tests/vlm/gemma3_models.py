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


# A Gemma-style chat template: an image part becomes <start_of_image> (Gemma3Processor expands it).
CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for m in messages -%}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{%- if m['content'] is string -%}{{ m['content'] }}{%- else -%}{%- for p in m['content'] -%}"
    "{%- if p['type'] == 'image' -%}<start_of_image>{%- elif p['type'] == 'text' -%}{{ p['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}<end_of_turn>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<start_of_turn>model\n{%- endif -%}")
SPECIAL = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


def build_gemma3(folder: pathlib.Path, seed: int = 0, sliding_window: int = 8,
                 tokenizer_dir: pathlib.Path | None = None) -> pathlib.Path:
    """sliding_window smaller than an image's tokens: the image mask must reach past the window (transformers ORs
    it onto the sliding mask too). tokenizer_dir (the default model's): the folder also gets that tokenizer with
    Gemma 3's three image tokens and this chat template, so the gateway (and Gemma3Processor) can serve it."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor
    ids = {"vocab": VOCAB, "boi": BOI, "image": IMAGE_TOKEN, "eoi": EOI, "eos": 1}
    if tokenizer_dir is not None:
        ids = _save_tokenizer(folder, tokenizer_dir)
    torch.manual_seed(seed)
    cfg = Gemma3Config(
        text_config={"vocab_size": ids["vocab"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                     "max_position_embeddings": 1024, "sliding_window": sliding_window,
                     "layer_types": ["full_attention", "sliding_attention", "full_attention"],
                     "query_pre_attn_scalar": 16, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                     "initializer_range": 0.2, "eos_token_id": ids["eos"], "pad_token_id": 0, "bos_token_id": 2,
                     "tie_word_embeddings": False},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": IMAGE_SIZE, "patch_size": PATCH, "vision_use_head": False},
        mm_tokens_per_image=TOKENS_PER_IMAGE, boi_token_index=ids["boi"], eoi_token_index=ids["eoi"],
        image_token_index=ids["image"], initializer_range=0.2, tie_word_embeddings=False, eos_token_id=ids["eos"],
        pad_token_id=0, bos_token_id=2)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():       # a random init leaves the projection and norms at zero: give them values
        for name, p in model.named_parameters():
            if "norm" in name or "mm_input_projection" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(folder)
    return folder


def _save_tokenizer(folder: pathlib.Path, tokenizer_dir: pathlib.Path) -> dict[str, int]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir, extra_special_tokens=SPECIAL)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    boi, image, eoi = tok.convert_tokens_to_ids([SPECIAL["boi_token"], SPECIAL["image_token"], SPECIAL["eoi_token"]])
    return {"vocab": len(tok) + 40, "boi": boi, "image": image, "eoi": eoi, "eos": tok.eos_token_id}


def gemma3_processor(folder: pathlib.Path):
    """transformers' Gemma3Processor for the folder (its tokenizer and image processor): the gateway's oracle."""
    from transformers import AutoTokenizer, Gemma3ImageProcessor, Gemma3Processor
    return Gemma3Processor(Gemma3ImageProcessor.from_pretrained(folder), AutoTokenizer.from_pretrained(folder),
                           image_seq_length=TOKENS_PER_IMAGE)


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
    kwargs = {"token_type_ids": (input_ids == model.config.image_token_index).long()}
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
