"""Image parts of the three APIs, read into one form, ImageRef, and loaded together.

    OpenAI chat     {"type": "image_url", "image_url": {"url": URL, "detail": ...}}   (or "image_url": URL, as vLLM)
    Responses       {"type": "input_image", "image_url": URL, "detail": ...}          (file_id: refused)
    Anthropic       {"type": "image", "source": {"type": "base64", "media_type", "data"} | {"type": "url", "url"}}

Parsing is synchronous and only checks the part's shape; `load_images` then fetches and decodes every image of a
request at once. The same image sent through any of the three APIs loads to the same LoadedImage (same hash).
Errors carry the API's own `param` ("messages", "input") and say in their text which part failed, since Anthropic's
error body has no param field.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from steploop.common import tracing
from steploop.gateway.errors import APIError, bad_request
from steploop.gateway.media.decode import LoadedImage
from steploop.gateway.media.loader import load_base64_image, load_image
from steploop.gateway.media.policy import MediaPolicy

DETAILS = ("auto", "low", "high")    # OpenAI's detail levels: accepted; the model's processor decides the size


@dataclass(frozen=True)
class ImageRef:
    """One image of a request before loading: a URL or bare base64, and where in the request it was."""
    where: str                      # the part's path, e.g. "messages[0].content[1]": every error starts with it
    param: str                      # the API's param for errors: "messages" (chat, Anthropic), "input" (Responses)
    url: str | None = None          # data:, http(s): or file: URL
    base64: str | None = None       # bare base64 (Anthropic's base64 source)
    media_type: str | None = None   # declared with base64; must match the bytes

    @property
    def kind(self) -> str:
        """How the image comes: "data", "http", "https", "file" (URL schemes) or "base64"."""
        return self.url.split(":", 1)[0].lower() if self.url is not None else "base64"

    async def load(self, policy: MediaPolicy) -> LoadedImage:
        with _span("load image", {"steploop.image.part": self.where, "steploop.image.kind": self.kind}) as span:
            try:
                if self.url is not None:
                    loaded = await load_image(self.url, policy, param=self.param)
                else:
                    loaded = await asyncio.to_thread(load_base64_image, self.base64 or "", self.media_type, policy,
                                                     param=self.param)
            except APIError as err:
                raise APIError(err.status, f"{self.where}: {err.message}", type=err.type, param=err.param,
                               code=err.code, headers=err.headers) from None
            if span is not None:
                span.set_attributes({"steploop.image.hash": loaded.hash, "steploop.image.width": loaded.size[0],
                                     "steploop.image.height": loaded.size[1]})
            return loaded


async def load_images(refs: list[ImageRef] | tuple[ImageRef, ...], policy: MediaPolicy) -> list[LoadedImage]:
    """Every image loaded concurrently, in order; the first failure cancels the rest and is raised."""
    if len(refs) > policy.max_images_per_prompt:
        limit = policy.max_images_per_prompt
        raise bad_request(f"{len(refs)} images in one request, more than the {limit} this server allows "
                          f"(--limit-mm-per-prompt image={limit})", param=refs[limit].param,
                          code="too_many_images")
    if not refs:
        return []
    with _span("load images", {"steploop.images": len(refs)}):
        tasks = [asyncio.ensure_future(ref.load(policy)) for ref in refs]    # each a child span of this one
        try:
            done, _pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in tasks:                       # the first failure in request order among those finished
                if task in done and task.exception() is not None:
                    raise task.exception()
            return [task.result() for task in tasks]
        finally:
            for task in tasks:
                task.cancel()


def _span(name: str, attributes: dict[str, Any]) -> Any:
    """A span of the current trace while tracing is on (it records an escaping error); else nothing, as None."""
    if not tracing.ENABLED:
        return contextlib.nullcontext()
    return tracing.tracer().start_as_current_span(name, attributes={tracing.SERVICE: "gateway", **attributes})


def user_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A user message's content in the shared form: its text alone stays a string (exactly as before images), with
    an image the parts list [{"type": "text", "text"}, {"type": "image", "image": ImageRef}, ...] in order."""
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _shape_error(where: str, param: str, expected: str) -> APIError:
    return bad_request(f"{where} must be {expected}", param=param, code="invalid_value")


def _check_detail(part: dict[str, Any], where: str, param: str) -> None:
    detail = part.get("detail")
    if detail is not None and detail not in DETAILS:
        raise bad_request(f"{where}.detail must be one of {', '.join(DETAILS)}, got {detail!r}", param=param)


def openai_image_part(part: dict[str, Any], where: str, param: str = "messages") -> ImageRef:
    """Chat completions' image_url part; `image_url` may be the URL string itself (vLLM accepts that too)."""
    image_url = part.get("image_url")
    if isinstance(image_url, str):
        return ImageRef(where=where, param=param, url=image_url)
    if not isinstance(image_url, dict) or not isinstance(image_url.get("url"), str):
        raise _shape_error(where, param, "{'type': 'image_url', 'image_url': {'url': str, 'detail'?: str}}")
    _check_detail(image_url, f"{where}.image_url", param)
    return ImageRef(where=where, param=param, url=image_url["url"])


def responses_image_part(part: dict[str, Any], where: str, param: str = "input") -> ImageRef:
    """Responses' input_image part: an image_url (any URL form load_image takes); file_id needs the Files API."""
    if part.get("file_id") is not None and part.get("image_url") is None:
        raise bad_request(f"{where}.file_id is not supported: send the image as image_url (a data: or https: URL)",
                          param=param)
    if not isinstance(part.get("image_url"), str):
        raise _shape_error(where, param, "{'type': 'input_image', 'image_url': str, 'detail'?: str}")
    _check_detail(part, where, param)
    return ImageRef(where=where, param=param, url=part["image_url"])


def anthropic_image_block(block: dict[str, Any], where: str, param: str = "messages") -> ImageRef:
    """Anthropic's image block: a base64 source (media_type checked against the bytes) or a url source."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        if not isinstance(source.get("data"), str) or not isinstance(source.get("media_type"), str):
            raise _shape_error(f"{where}.source", param, "{'type': 'base64', 'media_type': str, 'data': str}")
        return ImageRef(where=where, param=param, base64=source["data"], media_type=source["media_type"])
    if kind == "url":
        if not isinstance(source.get("url"), str):
            raise _shape_error(f"{where}.source", param, "{'type': 'url', 'url': str}")
        return ImageRef(where=where, param=param, url=source["url"])
    if kind == "file":
        raise bad_request(f"{where}.source type 'file' is not supported: send the image as base64 or url",
                          param=param)
    raise _shape_error(f"{where}.source", param, "an image source of type 'base64' or 'url'")
