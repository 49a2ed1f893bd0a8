"""Encoded image bytes -> LoadedImage: format and pixel limits checked from the header, before decoding.

The pixels the model sees are RGB; an image with transparency is composited over white first, as transformers'
`convert_to_rgb` and vLLM do. The hash is of those RGB pixels (mode, size, bytes), so the same picture sent as PNG or
lossless WebP agrees, and any change of a pixel differs: it is the key of the encoder cache and part of prefix-cache
keys, and must depend on nothing but what the encoder is given.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from steploop.gateway.errors import APIError, bad_request
from steploop.gateway.media.policy import MediaPolicy

# Formats a client may send: those OpenAI, Anthropic and vLLM document, plus BMP. Only their decoders ever see the
# bytes: others (TIFF, PSD, EPS...) have large, rarely exercised parsers, so they are named from their magic bytes
# below and refused without being parsed.
SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_OTHER_FORMATS = ((b"II*\0", "TIFF"), (b"MM\0*", "TIFF"), (b"8BPS", "PSD"), (b"%PDF", "PDF"), (b"%!PS", "EPS"),
                  (b"\0\0\1\0", "ICO"), (b"\0\0\2\0", "CUR"), (b"\0\0\0\x0cjP  ", "JPEG 2000"),
                  (b"\xff\x4f\xff\x51", "JPEG 2000"), (b"qoif", "QOI"), (b"DDS ", "DDS"), (b"icns", "ICNS"),
                  (b"\xff\x0a", "JPEG XL"), (b"\0\0\0\x0cJXL ", "JPEG XL"))
_FTYP_BRANDS = {b"avif": "AVIF", b"avis": "AVIF", b"heic": "HEIC", b"heix": "HEIC", b"mif1": "HEIF", b"msf1": "HEIF"}
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP",
               "image/gif": "GIF", "image/bmp": "BMP"}


@dataclass(frozen=True)
class LoadedImage:
    image: Image.Image   # decoded, mode RGB
    hash: str            # hex sha256 of b"RGB", width, height and the RGB pixel bytes
    source: str          # short description for logs and errors: "data: URL (PNG, 12 KiB)", "https://host/a.png"

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size   # (width, height)


def pixel_hash(image: Image.Image) -> str:
    """sha256 over mode, size and pixel bytes: equal exactly when the decoded pixels are equal."""
    digest = hashlib.sha256()
    digest.update(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def decode_image(data: bytes, policy: MediaPolicy, *, source: str, param: str | None,
                 expected_format: str | None = None) -> LoadedImage:
    """Decodes `data` (already within max_image_bytes) or raises a 400 naming what is wrong with it."""
    if len(data) > policy.max_image_bytes:
        raise too_many_bytes(source, len(data), policy, param)
    if not data:
        raise bad_request(f"image from {source} is empty (0 bytes)", param=param, code="invalid_image")
    image = _open(data, source, param)
    _check_format(image, source, param, expected_format)
    _check_pixels(image, source, policy, param)
    rgb = _to_rgb(_load(image, source, param))
    return LoadedImage(image=rgb, hash=pixel_hash(rgb), source=source)


def too_many_bytes(source: str, size: int | None, policy: MediaPolicy, param: str | None) -> APIError:
    """`size`: the bytes counted or declared; None when reading stopped at the limit."""
    got = f"{size} bytes, more" if size is not None else "more bytes"
    return bad_request(f"image from {source} is too large: {got} than the {policy.max_image_bytes} allowed "
                       f"(--max-image-bytes)", param=param, code="image_too_large")


def _open(data: bytes, source: str, param: str | None) -> Image.Image:
    """Reads only the header: format and size, no pixel data yet."""
    try:
        return Image.open(io.BytesIO(data), formats=SUPPORTED_FORMATS)
    except Image.DecompressionBombError as exc:   # PIL's own ceiling, 2x Image.MAX_IMAGE_PIXELS
        raise bad_request(f"image from {source} has too many pixels ({exc})", param=param,
                          code="image_too_large") from None
    except UnidentifiedImageError:
        other = sniff_other_format(data)
        if other is not None:
            raise unsupported_format(source, other, param) from None
        raise bad_request(f"image from {source} is not an image this server can decode (corrupt, or not one of "
                          f"{', '.join(SUPPORTED_FORMATS)})", param=param, code="invalid_image") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise bad_request(f"image from {source} is corrupt: {exc}", param=param, code="invalid_image") from None


def sniff_other_format(data: bytes) -> str | None:
    """The name of a known image format we do not decode, from its first bytes; None if it is none of them."""
    for magic, name in _OTHER_FORMATS:
        if data.startswith(magic):
            return name
    if data[4:8] == b"ftyp":
        return _FTYP_BRANDS.get(data[8:12])
    head = data[:256].lstrip().lower()
    if head.startswith(b"<svg") or (head.startswith(b"<?xml") and b"<svg" in head):
        return "SVG"
    return None


def unsupported_format(source: str, name: str, param: str | None) -> APIError:
    return bad_request(f"image from {source} is in an unsupported format {name}; supported: "
                       f"{', '.join(SUPPORTED_FORMATS)}", param=param, code="unsupported_image_format")


def _check_format(image: Image.Image, source: str, param: str | None, expected: str | None) -> None:
    if image.format not in SUPPORTED_FORMATS:        # (open() tried only those; kept as the guard it relies on)
        raise unsupported_format(source, str(image.format), param)
    if expected is not None and image.format != expected:
        raise bad_request(f"image from {source} is {image.format}, but its media type says {expected}",
                          param=param, code="invalid_image")


def _check_pixels(image: Image.Image, source: str, policy: MediaPolicy, param: str | None) -> None:
    width, height = image.size
    if width < 1 or height < 1:
        raise bad_request(f"image from {source} has no pixels ({width}x{height})", param=param, code="invalid_image")
    if width * height > policy.max_image_pixels:
        raise bad_request(f"image from {source} has too many pixels: {width}x{height} = {width * height}, more than "
                          f"the {policy.max_image_pixels} allowed (--max-image-pixels)", param=param,
                          code="image_too_large")


def _load(image: Image.Image, source: str, param: str | None) -> Image.Image:
    """Decodes the pixel data (the first frame of an animation); a truncated or corrupt body is a 400."""
    try:
        image.load()
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        kind = "truncated" if "truncated" in str(exc) else "corrupt"
        raise bad_request(f"image from {source} is {kind}: {exc}", param=param, code="invalid_image") from None
    return image


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    has_alpha = image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info)
    if not has_alpha:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")
