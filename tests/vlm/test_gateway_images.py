"""OpenAI chat image_url parts through the gateway (a fake engine behind it), with the tiny Qwen2.5-VL's own folder
(tokenizer with its vision tokens, chat template, image processor): each <|image_pad|> between <|vision_start|> and
<|vision_end|> is expanded to the image's tokens and the engine gets the processor's exact pixels per image.
(tests/gateway/test_gateway_images.py covers the three APIs, the limits and the text-only 400.)"""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import pytest_asyncio

from steploop.common.model_path import default_model_dir
from steploop.gateway.config import GatewayConfig
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.media import MediaPolicy
from steploop.gateway.text.tokenizer import load_tokenizer
from tests.gateway.conftest import serving_app
from tests.gateway.fake_engine import FakeEngine, start_fake_engine
from tests.vlm.vlm_models import build_qwen2_5_vl, png_bytes, processed


def image_part(png: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}


@pytest.fixture(scope="module")
def vlm_with_tokenizer(tmp_path_factory):
    return build_qwen2_5_vl(tmp_path_factory.mktemp("vlm_tok"), tokenizer_dir=default_model_dir())


@pytest_asyncio.fixture
async def served(vlm_with_tokenizer):
    """(openai client, fake engine, tokenizer) for a gateway serving the tiny VLM, images limited to 2."""
    tokenizer = load_tokenizer(vlm_with_tokenizer)
    engine = FakeEngine(reply_ids=[tokenizer.eos_token_id], eos_token_id=tokenizer.eos_token_id)
    server, address, _ = await start_fake_engine(engine)
    config = GatewayConfig(port=0, model=str(vlm_with_tokenizer), served_model_name="vlm",
                           media=MediaPolicy(max_images_per_prompt=2))
    try:
        async with serving_app(EngineClient(address), tokenizer, config) as (url, _app):
            yield openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0), engine, tokenizer
    finally:
        await server.stop(None)


async def test_image_parts_reach_the_engine_expanded(served):
    client, engine, tokenizer = served
    first, second = png_bytes(112, 84, 1), png_bytes(56, 140, 3)
    await client.chat.completions.create(model="vlm", max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, image_part(first), {"type": "text", "text": "and"}, image_part(second)]}])
    sent = engine.requests[-1]
    ids = list(sent.prompt_token_ids)
    image_token = tokenizer.hf.convert_tokens_to_ids("<|image_pad|>")
    assert len(sent.mm_features) == 2
    for feature, png in zip(sent.mm_features, (first, second)):
        pixels, grid = processed(png)
        assert tuple(feature.grid_thw) == grid and feature.length == grid[1] * grid[2] // 4
        assert ids[feature.offset - 1] == tokenizer.hf.convert_tokens_to_ids("<|vision_start|>")
        assert ids[feature.offset:feature.offset + feature.length] == [image_token] * feature.length
        assert ids[feature.offset + feature.length] == tokenizer.hf.convert_tokens_to_ids("<|vision_end|>")
        got = np.frombuffer(feature.pixel_values, "<f4").reshape(tuple(feature.pixel_shape))
        np.testing.assert_array_equal(got, pixels)
    assert ids.count(image_token) == sum(f.length for f in sent.mm_features)
    assert sent.mm_features[0].hash != sent.mm_features[1].hash


async def test_pixels_too_large_for_one_request_are_a_400(served, monkeypatch):
    from steploop.gateway.text import image_prompts
    monkeypatch.setattr(image_prompts, "MAX_PIXEL_BYTES", 1024)      # one 112x84 image is 48 x 1176 floats
    client, engine, _ = served
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model="vlm", max_tokens=4, messages=[
            {"role": "user", "content": [image_part(png_bytes(112, 84, 1))]}])
    assert "MiB of processed pixels" in exc.value.message and exc.value.code == "image_too_large"
    assert engine.requests == []


async def test_images_per_request_histogram_counts_served_requests(served):
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families
    client, _, _ = served
    await client.chat.completions.create(model="vlm", max_tokens=4, messages=[{"role": "user", "content": [
        image_part(png_bytes(112, 84, 1)), image_part(png_bytes(56, 140, 3))]}])
    await client.chat.completions.create(model="vlm", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    async with aiohttp.ClientSession() as session, session.get(f"{root}/metrics") as resp:
        text = await resp.text()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "steploop:request_images"]
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert samples[("steploop:request_images_count", None)] == 1          # the text-only request is not counted
    assert samples[("steploop:request_images_sum", None)] == 2
    assert samples[("steploop:request_images_bucket", "1.0")] == 0
    assert samples[("steploop:request_images_bucket", "2.0")] == 1
