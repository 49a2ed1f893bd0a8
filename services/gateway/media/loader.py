"""The two entry points: an image URL (data:, http(s):, file:) or bare base64 -> LoadedImage, or a 400 naming why not.

`param` is the request field the image came from (`messages[0].content[1].image_url.url`); every error names it.
Base64 and image decoding run in a thread (load_image), so a large image does not stall the gateway's event loop;
load_base64_image is synchronous: call it from a thread (ImageRef.load does).
"""

from __future__ import annotations

import asyncio

from aiohttp.abc import AbstractResolver

from steploop.gateway.errors import bad_request
from steploop.gateway.media import inline
from steploop.gateway.media.decode import LoadedImage, decode_image
from steploop.gateway.media.fetch import fetch_image_bytes
from steploop.gateway.media.policy import MediaPolicy

DEFAULT_PARAM = "image_url"


async def load_image(url: str, policy: MediaPolicy, *, param: str | None = DEFAULT_PARAM,
                     resolver: AbstractResolver | None = None) -> LoadedImage:
    """Loads one image URL under `policy`. `resolver`: the DNS resolver under the address check (tests)."""
    if not isinstance(url, str) or not url.strip():
        raise bad_request("image URL must be a non-empty string", param=param, code="invalid_image_url")
    url = url.strip()
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data, media_type = inline.parse_data_url(url, param)
        source = f"data: URL ({media_type or 'no media type'})"
        return await asyncio.to_thread(_decode_base64_image, data, policy, source, param, None)
    if scheme == "file":
        raw, source = await asyncio.to_thread(inline.read_file_url, url, policy, param)
    elif scheme in ("http", "https"):
        raw, source = await fetch_image_bytes(url, policy, param=param, resolver=resolver)
    else:
        raise bad_request(f"image URL scheme {scheme or '(none)'!r} is not supported; use data:, http:, https: or "
                          f"file: (with --allowed-local-media-path)", param=param, code="invalid_image_url")
    return await asyncio.to_thread(decode_image, raw, policy, source=source, param=param)


def load_base64_image(data: str, media_type: str | None, policy: MediaPolicy, *,
                      param: str | None = "source.data") -> LoadedImage:
    """An Anthropic base64 image block's `data`; a declared media type must match what the bytes are."""
    source = f"base64 data ({media_type or 'no media type'})"
    fmt = inline.expected_format(media_type, source, param)
    return _decode_base64_image(data, policy, source, param, fmt)


def _decode_base64_image(data: str, policy: MediaPolicy, source: str, param: str | None,
                         fmt: str | None) -> LoadedImage:
    raw = inline.decode_base64(data, policy, source, param)
    return decode_image(raw, policy, source=source, param=param, expected_format=fmt)
