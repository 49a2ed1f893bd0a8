"""Gemma 3 image parts through the gateway (a fake engine behind it), with the tiny model's own folder (tokenizer
with Gemma 3's image tokens, chat template, Gemma3ImageProcessor): the engine gets exactly the token ids and pixels
transformers' Gemma3Processor makes from the rendered prompt and the images (OpenAI chat and Anthropic messages), and
each feature covers one image's <image_soft_token> run."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
import pytest_asyncio

from steploop.common.model_path import default_model_dir
from steploop.gateway.config import GatewayConfig
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.text.tokenizer import load_tokenizer
from tests.gateway.conftest import serving_app
from tests.gateway.fake_engine import FakeEngine, start_fake_engine
from tests.vlm.gemma3_models import TOKENS_PER_IMAGE, build_gemma3, gemma3_processor, png_bytes


def image_part(png: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}


@pytest.fixture(scope="module")
def gemma3_with_tokenizer(tmp_path_factory):
    return build_gemma3(tmp_path_factory.mktemp("gemma3_tok"), tokenizer_dir=default_model_dir())


@pytest_asyncio.fixture
async def served(gemma3_with_tokenizer):
    tokenizer = load_tokenizer(gemma3_with_tokenizer)
    engine = FakeEngine(reply_ids=[tokenizer.eos_token_id], eos_token_id=tokenizer.eos_token_id)
    server, address, _ = await start_fake_engine(engine)
    config = GatewayConfig(port=0, model=str(gemma3_with_tokenizer), served_model_name="gemma3")
    try:
        async with serving_app(EngineClient(address), tokenizer, config) as (url, _app):
            yield openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0), engine, url
    finally:
        await server.stop(None)


def processor_inputs(folder, parts: list, pngs: list[bytes]):
    """Gemma3Processor on the template's text for the same parts: (input_ids, pixel_values [n, 3, H, W])."""
    from PIL import Image
    processor = gemma3_processor(folder)
    content = [{"type": "image"} if p["type"] == "image_url" else p for p in parts]
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True)
    images = [Image.open(io.BytesIO(png)).convert("RGB") for png in pngs]
    out = processor(text=text, images=images, return_tensors="np", add_special_tokens=False)
    return out["input_ids"][0].tolist(), out["pixel_values"]


async def test_image_parts_reach_the_engine_as_gemma3_processor_makes_them(served, gemma3_with_tokenizer):
    client, engine, _ = served
    pngs = [png_bytes(40, 30, 1), png_bytes(24, 36, 3)]
    parts = [image_part(pngs[0]), {"type": "text", "text": "and\n"}, image_part(pngs[1]),
             {"type": "text", "text": "compare"}]           # an image right after "user\n", one after a newline
    await client.chat.completions.create(model="gemma3", max_tokens=4, messages=[{"role": "user", "content": parts}])
    sent = engine.requests[-1]
    want_ids, want_pixels = processor_inputs(gemma3_with_tokenizer, parts, pngs)
    assert list(sent.prompt_token_ids) == want_ids
    soft = gemma3_processor(gemma3_with_tokenizer).image_token_id
    assert len(sent.mm_features) == 2
    for feature, pixels in zip(sent.mm_features, want_pixels):
        assert feature.length == TOKENS_PER_IMAGE
        assert want_ids[feature.offset:feature.offset + feature.length] == [soft] * TOKENS_PER_IMAGE
        assert want_ids[feature.offset - 1] != soft and want_ids[feature.offset + feature.length] != soft
        got = np.frombuffer(feature.pixel_values, "<f4").reshape(tuple(feature.pixel_shape))
        np.testing.assert_array_equal(got, pixels)


async def test_image_tokens_typed_in_the_text_are_a_400(served):
    client, engine, _ = served
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model="gemma3", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "<image_soft_token>"}, image_part(png_bytes(40, 30, 1))]}])
    assert "image tokens of its own" in exc.value.message
    assert engine.requests == []


async def test_anthropic_base64_image_reaches_the_engine_as_the_processor_makes_it(served, gemma3_with_tokenizer):
    import anthropic
    _, engine, url = served
    png = png_bytes(24, 36, 4)
    client = anthropic.AsyncAnthropic(base_url=url, api_key="none", max_retries=0)
    await client.messages.create(model="gemma3", max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(png).decode()}},
        {"type": "text", "text": "What is it?"}]}])
    sent = engine.requests[-1]
    want_ids, want_pixels = processor_inputs(gemma3_with_tokenizer, [image_part(png),
                                                                     {"type": "text", "text": "What is it?"}], [png])
    assert list(sent.prompt_token_ids) == want_ids and len(sent.mm_features) == 1
    got = np.frombuffer(sent.mm_features[0].pixel_values, "<f4").reshape(tuple(sent.mm_features[0].pixel_shape))
    np.testing.assert_array_equal(got, want_pixels[0])
