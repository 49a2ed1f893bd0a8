"""Image bytes for the media tests, made here (no files shipped): PNG/JPEG/WebP encodings and crafted headers."""

from __future__ import annotations

import base64
import io
import struct
import zlib

from PIL import Image


def noise_image(width: int = 16, height: int = 12, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Deterministic varied pixels (JPEG cannot reproduce them exactly)."""
    channels = len(mode)
    data = bytes((i * 131 + seed * 17 + (i // 7) * 29) % 256 for i in range(width * height * channels))
    return Image.frombytes(mode, (width, height), data)


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **kwargs)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height, with one tiny IDAT: a decompression bomb's header, cheaply."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")
