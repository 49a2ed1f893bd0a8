"""Image parts of OpenAI chat, Responses and Anthropic Messages: one ImageRef form, loaded alike, errors placed."""

from __future__ import annotations

import asyncio
import base64

import pytest
import pytest_asyncio
from aiohttp import web

from steploop.gateway.errors import APIError
from steploop.gateway.media import MediaPolicy, parts
from tests.gateway.media_images import data_url, encode, noise_image
from tests.span_recorder import recorded_spans

ImageRef, load_images = parts.ImageRef, parts.load_images
openai_image_part, responses_image_part = parts.openai_image_part, parts.responses_image_part
anthropic_image_block = parts.anthropic_image_block
PNG = encode(noise_image(), "PNG")
B64 = base64.b64encode(PNG).decode()


@pytest_asyncio.fixture
async def image_host():
    """http://127.0.0.1:<port>/a.png serves PNG; /hang never answers (until teardown)."""
    release = asyncio.Event()

    async def image(request):
        return web.Response(body=PNG, content_type="image/png")

    async def hang(request):
        await release.wait()
        return web.Response(body=PNG)

    app = web.Application()
    app.router.add_get("/a.png", image)
    app.router.add_get("/hang", hang)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    release.set()
    await runner.cleanup()


LOCAL = MediaPolicy(allowed_media_domains=("127.0.0.1",), fetch_timeout=5.0)


async def test_the_same_image_through_every_api_loads_alike(image_host):
    refs = [
        openai_image_part({"type": "image_url", "image_url": {"url": data_url(PNG), "detail": "high"}},
                          "messages[0].content[0]"),
        openai_image_part({"type": "image_url", "image_url": f"{image_host}/a.png"}, "messages[0].content[1]"),
        responses_image_part({"type": "input_image", "image_url": data_url(PNG), "detail": "auto"},
                             "input[0].content[0]"),
        anthropic_image_block({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}},
                              "messages[0].content[0]"),
        anthropic_image_block({"type": "image", "source": {"type": "url", "url": f"{image_host}/a.png"}},
                              "messages[0].content[1]"),
    ]
    loaded = await load_images(refs, LOCAL)
    assert len({image.hash for image in loaded}) == 1
    assert [image.image.tobytes() for image in loaded] == [noise_image().tobytes()] * 5


async def test_order_is_kept():
    other = encode(noise_image(seed=3), "PNG")
    refs = [ImageRef("a", "messages", url=data_url(other)), ImageRef("b", "messages", url=data_url(PNG))]
    first, second = await load_images(refs, MediaPolicy())
    assert first.image.tobytes() == noise_image(seed=3).tobytes()
    assert second.image.tobytes() == noise_image().tobytes()
    assert await load_images([], MediaPolicy()) == []


async def test_an_error_names_the_part_and_the_api_param():
    refs = [ImageRef("input[0].content[0]", "input", url=data_url(PNG)),
            ImageRef("input[0].content[1]", "input", url="data:image/png;base64,####")]
    with pytest.raises(APIError) as info:
        await load_images(refs, MediaPolicy())
    assert info.value.status == 400 and info.value.param == "input"
    assert info.value.message.startswith("input[0].content[1]: image from data: URL") and "base64" in \
        info.value.message


async def test_a_failure_cancels_the_other_fetches(image_host):
    refs = [ImageRef("messages[0].content[0]", "messages", url=f"{image_host}/hang"),
            ImageRef("messages[0].content[1]", "messages", url="data:image/png;base64,AAAA")]
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(APIError) as info:
        await load_images(refs, LOCAL)
    assert info.value.message.startswith("messages[0].content[1]:")
    assert loop.time() - started < 2.0            # not the 5 s the hanging fetch would take


async def test_too_many_images_are_refused_before_loading():
    refs = [ImageRef(f"messages[0].content[{i}]", "messages", url="https://never.example/a.png") for i in range(3)]
    with pytest.raises(APIError) as info:
        await load_images(refs, MediaPolicy(max_images_per_prompt=2))
    assert "3 images in one request, more than the 2" in info.value.message
    assert "--limit-mm-per-prompt" in info.value.message and info.value.code == "too_many_images"
    with pytest.raises(APIError):
        await load_images(refs[:1], MediaPolicy(max_images_per_prompt=0))


async def test_anthropic_media_type_must_match_the_bytes():
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/gif", "data": B64}}
    with pytest.raises(APIError) as info:
        await load_images([anthropic_image_block(block, "messages[1].content[0]")], MediaPolicy())
    assert info.value.message.startswith("messages[1].content[0]: ") and "is PNG, but its media type says GIF" in \
        info.value.message


async def test_loading_is_traced_when_tracing_is_on():
    with recorded_spans() as memory:
        await load_images([ImageRef("messages[0].content[0]", "messages", url=data_url(PNG))], MediaPolicy())
        with pytest.raises(APIError):
            await load_images([ImageRef("messages[0].content[1]", "messages", base64="@@", media_type="image/png")],
                              MediaPolicy())
    spans = {(s.name, s.attributes.get("steploop.image.part")): s for s in memory.get_finished_spans()}
    ok, failed = spans["load image", "messages[0].content[0]"], spans["load image", "messages[0].content[1]"]
    assert ok.attributes["steploop.image.kind"] == "data" and ok.attributes["steploop.image.width"] == 16
    assert len(ok.attributes["steploop.image.hash"]) == 64
    assert failed.attributes["steploop.image.kind"] == "base64" and not failed.status.is_ok
    parents = [s for s in memory.get_finished_spans() if s.name == "load images"]
    assert len(parents) == 2 and ok.parent.span_id == parents[0].context.span_id
    await load_images([ImageRef("a", "messages", url=data_url(PNG))], MediaPolicy())     # off: no span
    assert len(memory.get_finished_spans()) == 4


@pytest.mark.parametrize("parse, part, words", [
    (openai_image_part, {"type": "image_url"}, "'image_url': {'url': str"),
    (openai_image_part, {"type": "image_url", "image_url": {"url": 3}}, "'image_url': {'url': str"),
    (openai_image_part, {"type": "image_url", "image_url": {"url": "x", "detail": "max"}},
     ".image_url.detail must be one of auto, low, high"),
    (responses_image_part, {"type": "input_image"}, "'image_url': str"),
    (responses_image_part, {"type": "input_image", "file_id": "file-1"}, "file_id is not supported"),
    (responses_image_part, {"type": "input_image", "image_url": "x", "detail": 1}, "detail must be one of"),
    (anthropic_image_block, {"type": "image"}, "source must be an image source of type 'base64' or 'url'"),
    (anthropic_image_block, {"type": "image", "source": {"type": "base64", "data": B64}},
     "'media_type': str"),
    (anthropic_image_block, {"type": "image", "source": {"type": "url"}}, "{'type': 'url', 'url': str}"),
    (anthropic_image_block, {"type": "image", "source": {"type": "file", "file_id": "f"}},
     "source type 'file' is not supported"),
])
def test_malformed_parts_are_refused_with_their_place(parse, part, words):
    with pytest.raises(APIError) as info:
        parse(part, "messages[2].content[1]")
    assert info.value.status == 400 and words in info.value.message
    assert info.value.message.startswith("messages[2].content[1]")
