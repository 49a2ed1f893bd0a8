"""Images through the gateway's three APIs, in front of the fake engine: OpenAI chat image_url, Anthropic image blocks
(base64 and url) and Responses input_image make the same engine request (prompt ids and image features); their
errors are each API's 400s naming the part.

The model folder is the test tokenizer with a vision model's config: a chat template that renders an image part as
one placeholder token, and Qwen2-VL's image processor (numpy, no download), so the gateway runs its real image path.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
from dataclasses import replace

import anthropic
import openai
import pytest
import pytest_asyncio
from aiohttp import web

from steploop.gateway.app_keys import IMAGE_PROMPTS
from steploop.gateway.config import GatewayConfig
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.media import MediaPolicy
from steploop.gateway.text.tokenizer import load_tokenizer
from tests.gateway.conftest import SERVED_NAME, Gateway, serving_app
from tests.gateway.fake_engine import start_fake_engine
from tests.gateway.media_images import data_url, encode, noise_image

PLACEHOLDER = "<file_sep>"           # an existing special token of the test tokenizer stands for the image token
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}" + PLACEHOLDER +
            "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "do_rescale": True,
             "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
             "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True, "min_pixels": 3136,
             "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
PNG = encode(noise_image(56, 56), "PNG")          # 4x4 patches of 14 -> 4 image tokens after the 2x2 merge
B64 = base64.b64encode(PNG).decode()
QUESTION = "What is in this picture?"


@pytest.fixture(scope="session")
def vlm_model_dir(gateway_model_dir, tokenizer, tmp_path_factory):
    """(`tokenizer` first: it imports transformers with torch, as later suites in this process need.)"""
    out = tmp_path_factory.mktemp("vlm")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (gateway_model_dir / name).exists():
            shutil.copy(gateway_model_dir / name, out / name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    image_token_id = load_tokenizer(out).encode_sync(PLACEHOLDER, add_special_tokens=False)
    assert len(image_token_id) == 1
    (out / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "image_token_id": image_token_id[0]}))
    (out / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return out


@pytest_asyncio.fixture
async def image_host():
    """The PNG at http://127.0.0.1:<port>/a.png (allow-listed below)."""
    async def image(request):
        return web.Response(body=PNG, content_type="image/png")
    app = web.Application()
    app.router.add_get("/a.png", image)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}/a.png"
    await runner.cleanup()


@pytest_asyncio.fixture
async def vlm(vlm_model_dir, fake_engine):
    config = GatewayConfig(port=0, served_model_name=SERVED_NAME, model=str(vlm_model_dir),
                           media=MediaPolicy(allowed_media_domains=("127.0.0.1",)))
    tokenizer = load_tokenizer(vlm_model_dir)
    server, address, health = await start_fake_engine(fake_engine)
    try:
        async with serving_app(EngineClient(address), tokenizer, config) as (url, app):
            yield Gateway(url, fake_engine, health, app)
    finally:
        await server.stop(None)
        tokenizer.close()


def engine_view(request) -> tuple:
    """What the engine is asked: the prompt ids and every image feature, field by field."""
    return (list(request.prompt_token_ids),
            [(f.hash, f.offset, f.length, list(f.grid_thw), list(f.pixel_shape), f.pixel_values)
             for f in request.mm_features])


@pytest_asyncio.fixture
async def clients():
    """clients.anthropic(gateway): an SDK client closed at teardown (so no transport outlives the test's loop)."""
    made = []

    class Clients:
        def anthropic(self, gateway) -> anthropic.AsyncAnthropic:
            made.append(anthropic.AsyncAnthropic(base_url=gateway.url, api_key="none", max_retries=0))
            return made[-1]

        def openai(self, gateway) -> openai.AsyncOpenAI:
            made.append(gateway.openai())
            return made[-1]
    yield Clients()
    for client in made:
        await client.close()


async def test_the_three_apis_make_the_same_engine_request(vlm, image_host, clients):
    await clients.openai(vlm).chat.completions.create(model=SERVED_NAME, max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": data_url(PNG)}}]}])
    for source in ({"type": "base64", "media_type": "image/png", "data": B64}, {"type": "url", "url": image_host}):
        await clients.anthropic(vlm).messages.create(model=SERVED_NAME, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image", "source": source}]}])
    await clients.openai(vlm).responses.create(model=SERVED_NAME, max_output_tokens=4, input=[{"role": "user", "content": [
        {"type": "input_text", "text": QUESTION}, {"type": "input_image", "image_url": data_url(PNG)}]}])
    views = [engine_view(r) for r in vlm.engine.requests]
    assert len(views) == 4 and all(view == views[0] for view in views)
    ids, features = views[0]
    assert len(features) == 1 and features[0][2] == 4 and features[0][3] == [1, 4, 4]
    image_token = ids[features[0][1]]
    assert ids[features[0][1]:features[0][1] + 4] == [image_token] * 4 and ids.count(image_token) == 4


async def test_images_keep_their_order_among_text(vlm, clients):
    other = encode(noise_image(56, 56, seed=5), "PNG")
    content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}},
               {"type": "text", "text": "and"},
               {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(other).decode()}}]
    await clients.anthropic(vlm).messages.create(model=SERVED_NAME, max_tokens=4,
                                                messages=[{"role": "user", "content": content}])
    await clients.openai(vlm).chat.completions.create(model=SERVED_NAME, max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(PNG)}}, {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": data_url(other)}}]}])
    first, second = (engine_view(r) for r in vlm.engine.requests)
    assert first == second
    hashes = [f[0] for f in first[1]]
    assert len(set(hashes)) == 2 and first[1][0][1] < first[1][1][1]


async def test_count_tokens_counts_the_image_tokens(vlm, clients):
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": B64}}]}]
    counted = await clients.anthropic(vlm).messages.count_tokens(model=SERVED_NAME, messages=messages)
    await clients.anthropic(vlm).messages.create(model=SERVED_NAME, max_tokens=4, messages=messages)
    assert counted.input_tokens == len(vlm.engine.requests[-1].prompt_token_ids)


async def test_previous_response_keeps_its_image(vlm, clients):
    first = await clients.openai(vlm).responses.create(model=SERVED_NAME, max_output_tokens=4, input=[
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION},
                                     {"type": "input_image", "image_url": data_url(PNG)}]}])
    await clients.openai(vlm).responses.create(model=SERVED_NAME, max_output_tokens=4, previous_response_id=first.id,
                                        input="And its colours?")
    before, after = (engine_view(r) for r in vlm.engine.requests)
    assert after[1] == before[1]                               # the same image, at the same place
    assert after[0][:len(before[0])] == before[0]


async def test_anthropic_bad_images_are_400s_naming_the_block(vlm, clients):
    client = clients.anthropic(vlm)
    cases = [
        ({"type": "base64", "media_type": "image/png", "data": "@@@"}, "messages[0].content[1]: ", "base64"),
        ({"type": "base64", "media_type": "image/jpeg", "data": B64}, "messages[0].content[1]: ",
         "is PNG, but its media type says JPEG"),
        ({"type": "url", "url": "http://169.254.169.254/latest/meta-data"}, "messages[0].content[1]: ",
         "host 169.254.169.254 is not in --allowed-media-domains"),
        ({"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG[:100]).decode()},
         "messages[0].content[1]: ", "truncated"),
    ]
    for source, where, words in cases:
        with pytest.raises(anthropic.BadRequestError) as info:
            await client.messages.create(model=SERVED_NAME, max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "text", "text": QUESTION}, {"type": "image", "source": source}]}])
        message = info.value.body["error"]["message"]
        assert message.startswith(where) and words in message, message
    assert vlm.engine.requests == []


async def test_responses_bad_images_are_400s_naming_input(vlm, clients):
    with pytest.raises(openai.BadRequestError) as info:
        await clients.openai(vlm).responses.create(model=SERVED_NAME, max_output_tokens=4, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": "ftp://example.com/a.png"}]}])
    error = info.value.body
    assert error["param"] == "input" and error["message"].startswith("input[0].content[0]: ")
    assert "scheme 'ftp'" in error["message"]
    with pytest.raises(openai.BadRequestError) as info:
        await clients.openai(vlm).responses.create(model=SERVED_NAME, max_output_tokens=4, input=[
            {"role": "assistant", "content": [{"type": "input_image", "image_url": data_url(PNG)}]}])
    assert "input_image only in user messages" in info.value.body["message"]


async def test_too_many_images_are_refused(vlm, clients):
    prompts = vlm.app[IMAGE_PROMPTS]
    prompts.policy = replace(prompts.policy, max_images_per_prompt=1)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}
    with pytest.raises(anthropic.BadRequestError) as info:
        await clients.anthropic(vlm).messages.create(model=SERVED_NAME, max_tokens=4, messages=[
            {"role": "user", "content": [block, block]}])
    assert "2 images in one request, more than the 1" in info.value.body["error"]["message"]


async def test_ssrf_through_the_api_is_refused_without_a_connection(vlm, clients):
    accepted = []

    async def on_connect(reader, writer):
        accepted.append(writer.get_extra_info("peername"))
        writer.close()
    listener = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    prompts = vlm.app[IMAGE_PROMPTS]
    prompts.policy = MediaPolicy()                     # the default: no allow-list
    try:
        for url in (f"http://127.0.0.1:{port}/a.png", f"http://localhost:{port}/a.png",
                    "http://169.254.169.254/latest/meta-data/"):
            with pytest.raises(openai.BadRequestError) as info:
                await clients.openai(vlm).chat.completions.create(model=SERVED_NAME, max_tokens=4, messages=[
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
            assert "is refused" in info.value.body["message"] and info.value.body["param"] == "messages"
            with pytest.raises(anthropic.BadRequestError) as info:
                await clients.anthropic(vlm).messages.create(model=SERVED_NAME, max_tokens=4, messages=[
                    {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": url}}]}])
            assert "is refused" in info.value.body["error"]["message"]
    finally:
        listener.close()
        await listener.wait_closed()
    assert accepted == [] and vlm.engine.requests == []


async def test_a_text_only_model_says_so(gateway, clients):
    with pytest.raises(anthropic.BadRequestError) as info:
        await clients.anthropic(gateway).messages.create(model=SERVED_NAME, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": B64}}]}])
    assert "text-only model" in info.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as info:
        await clients.openai(gateway).responses.create(model=SERVED_NAME, max_output_tokens=4, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": data_url(PNG)}]}])
    assert "text-only model" in info.value.body["message"] and info.value.body["param"] == "input"
    assert gateway.engine.requests == []
