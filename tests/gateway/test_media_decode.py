"""Images in the request (data: URLs, Anthropic base64, file: URLs): decoding, the pixel hash, and every refusal."""

from __future__ import annotations

import os

import pytest
from PIL import Image

from steploop.gateway.errors import APIError
from steploop.gateway.media import LoadedImage, MediaPolicy, load_base64_image, load_image
from tests.gateway.media_images import data_url, encode, noise_image, png_header_only

PARAM = "messages[0].content[1].image_url.url"


async def refused(url: str, policy: MediaPolicy | None = None) -> APIError:
    with pytest.raises(APIError) as info:
        await load_image(url, policy or MediaPolicy(), param=PARAM)
    assert info.value.status == 400 and info.value.param == PARAM
    return info.value


async def test_data_url_decodes_to_rgb_with_its_hash():
    picture = noise_image()
    loaded = await load_image(data_url(encode(picture, "PNG")), MediaPolicy())
    assert isinstance(loaded, LoadedImage)
    assert loaded.image.mode == "RGB" and loaded.image.size == (16, 12)
    assert loaded.image.tobytes() == picture.tobytes()
    assert len(loaded.hash) == 64 and "data: URL" in loaded.source


async def test_same_pixels_in_two_encodings_share_a_hash():
    picture = noise_image()
    png = await load_image(data_url(encode(picture, "PNG")), MediaPolicy())
    webp = await load_image(data_url(encode(picture, "WEBP", lossless=True), "image/webp"), MediaPolicy())
    bmp = load_base64_image(data_url(encode(picture, "BMP"))[len("data:image/png;base64,"):], "image/bmp",
                            MediaPolicy())
    assert png.hash == webp.hash == bmp.hash


async def test_different_pixels_differ():
    picture = noise_image()
    png = await load_image(data_url(encode(picture, "PNG")), MediaPolicy())
    jpeg = await load_image(data_url(encode(picture, "JPEG", quality=90), "image/jpeg"), MediaPolicy())
    other = noise_image(seed=1)
    assert jpeg.image.tobytes() != png.image.tobytes()     # lossy: the decoded pixels are not the PNG's
    assert jpeg.hash != png.hash
    assert (await load_image(data_url(encode(other, "PNG")), MediaPolicy())).hash != png.hash
    one_pixel = picture.copy()
    one_pixel.putpixel((3, 4), (0, 0, 0))
    assert (await load_image(data_url(encode(one_pixel, "PNG")), MediaPolicy())).hash != png.hash


async def test_same_pixels_at_another_size_differ():
    flat = Image.new("RGB", (4, 6), (9, 9, 9))
    turned = Image.new("RGB", (6, 4), (9, 9, 9))     # same bytes, other shape
    a = await load_image(data_url(encode(flat, "PNG")), MediaPolicy())
    b = await load_image(data_url(encode(turned, "PNG")), MediaPolicy())
    assert a.image.tobytes() == b.image.tobytes() and a.hash != b.hash


async def test_transparency_is_composited_over_white():
    rgba = Image.new("RGBA", (2, 2), (255, 0, 0, 0))        # fully transparent red
    loaded = await load_image(data_url(encode(rgba, "PNG")), MediaPolicy())
    assert loaded.image.mode == "RGB" and loaded.image.getpixel((0, 0)) == (255, 255, 255)
    white = await load_image(data_url(encode(Image.new("RGB", (2, 2), "white"), "PNG")), MediaPolicy())
    assert loaded.hash == white.hash


async def test_grayscale_and_palette_become_rgb():
    gray = await load_image(data_url(encode(Image.new("L", (3, 3), 77), "PNG")), MediaPolicy())
    assert gray.image.mode == "RGB" and gray.image.getpixel((1, 1)) == (77, 77, 77)
    gif = await load_image(data_url(encode(noise_image().convert("P"), "GIF"), "image/gif"), MediaPolicy())
    assert gif.image.mode == "RGB"


async def test_corrupt_bytes_are_refused():
    err = await refused(data_url(b"this is not an image at all"))
    assert "not an image this server can decode" in err.message and err.code == "invalid_image"


async def test_truncated_image_is_refused():
    png = encode(noise_image(64, 64), "PNG")
    err = await refused(data_url(png[: len(png) // 2]))
    assert "truncated" in err.message or "corrupt" in err.message


@pytest.mark.parametrize("data, name", [
    (encode(noise_image(), "TIFF"), "TIFF"),
    (encode(noise_image(), "ICO"), "ICO"),
    (b"8BPS\0\1" + bytes(40), "PSD"),
    (b"\0\0\0\x1cftypavif\0\0\0\0" + bytes(32), "AVIF"),
    (b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg"/>', "SVG"),
])
async def test_unsupported_format_is_refused_by_name(data, name):
    err = await refused(data_url(data, "image/png"))
    assert f"unsupported format {name}; supported: PNG, JPEG, WEBP, GIF, BMP" in err.message
    assert err.code == "unsupported_image_format"


async def test_unsupported_formats_never_reach_their_decoder(monkeypatch):
    from PIL import TiffImagePlugin

    def must_not_run(*args, **kwargs):
        raise AssertionError("the TIFF parser ran")
    monkeypatch.setattr(TiffImagePlugin.TiffImageFile, "_open", must_not_run)
    assert "TIFF" in (await refused(data_url(encode(noise_image(), "TIFF")))).message


async def test_empty_image_is_refused():
    err = await refused("data:image/png;base64,")
    assert "empty" in err.message


async def test_too_many_bytes_is_refused_before_decoding():
    png = encode(noise_image(32, 32), "PNG")
    err = await refused(data_url(png), MediaPolicy(max_image_bytes=len(png) - 1))
    assert "too large" in err.message and "--max-image-bytes" in err.message and err.code == "image_too_large"
    assert (await load_image(data_url(png), MediaPolicy(max_image_bytes=len(png)))).size == (32, 32)


async def test_too_many_pixels_is_refused_from_the_header():
    err = await refused(data_url(png_header_only(5000, 5000)), MediaPolicy(max_image_pixels=4096 * 4096))
    assert "5000x5000" in err.message and "--max-image-pixels" in err.message
    small = await refused(data_url(encode(noise_image(20, 20), "PNG")), MediaPolicy(max_image_pixels=399))
    assert "20x20 = 400" in small.message


async def test_decompression_bomb_beyond_pillows_ceiling_is_refused():
    err = await refused(data_url(png_header_only(100_000, 100_000)), MediaPolicy(max_image_pixels=10**11))
    assert "too many pixels" in err.message and err.code == "image_too_large"


@pytest.mark.parametrize("url, words", [
    ("data:image/png;base64,@@@@", "not valid base64"),
    ("data:image/png;base64,iVBORw0KGgo", "not valid base64"),            # bad padding
    ("data:image/png,rawbytes", "must be base64-encoded"),
    ("data:text/plain;base64,aGVsbG8=", "media type text/plain, not an image"),
    ("data:image/png;base64", "no ','"),
    ("gopher://example.com/a.png", "scheme 'gopher' is not supported"),
    ("no-scheme-at-all", "scheme '(none)' is not supported"),
    ("", "non-empty string"),
])
async def test_bad_urls_are_refused(url, words):
    assert words in (await refused(url)).message


def test_base64_block_checks_its_media_type():
    png = encode(noise_image(), "PNG")
    b64 = data_url(png)[len("data:image/png;base64,"):]
    assert load_base64_image(b64, "image/png", MediaPolicy()).size == (16, 12)
    assert load_base64_image(b64, None, MediaPolicy()).size == (16, 12)
    with pytest.raises(APIError) as mismatch:
        load_base64_image(b64, "image/jpeg", MediaPolicy())
    assert "is PNG, but its media type says JPEG" in mismatch.value.message
    assert mismatch.value.param == "source.data"
    with pytest.raises(APIError) as tiff:
        load_base64_image(b64, "image/tiff", MediaPolicy(), param="messages[0].content[0].source.media_type")
    assert "unsupported media type image/tiff" in tiff.value.message
    assert tiff.value.param == "messages[0].content[0].source.media_type"
    with pytest.raises(APIError) as bad:
        load_base64_image("not base64!", "image/png", MediaPolicy())
    assert "not valid base64" in bad.value.message and bad.value.code == "invalid_base64"


def test_line_wrapped_base64_is_accepted():
    b64 = data_url(encode(noise_image(), "PNG"))[len("data:image/png;base64,"):]
    wrapped = "\n".join(b64[i:i + 76] for i in range(0, len(b64), 76)) + "\n"
    assert load_base64_image(wrapped, "image/png", MediaPolicy()).hash == \
        load_base64_image(b64, "image/png", MediaPolicy()).hash


def test_base64_size_is_checked_before_decoding():
    huge = "A" * (4 * 1024 * 1024)        # 3 MiB decoded; never decoded
    with pytest.raises(APIError) as info:
        load_base64_image(huge, "image/png", MediaPolicy(max_image_bytes=1024 * 1024))
    assert "3145728 bytes, more than the 1048576 allowed" in info.value.message


async def test_file_urls_are_off_by_default(tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(encode(noise_image(), "PNG"))
    assert "file: URLs are off" in (await refused(path.as_uri())).message


async def test_file_url_below_the_allowed_folder_loads(tmp_path):
    path = tmp_path / "sub dir" / "a.png"
    path.parent.mkdir()
    path.write_bytes(encode(noise_image(), "PNG"))
    loaded = await load_image(path.as_uri(), MediaPolicy(allowed_local_media_path=str(tmp_path)))
    assert loaded.size == (16, 12) and loaded.source.startswith("file:")


async def test_file_urls_outside_the_folder_are_refused(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    secret = tmp_path / "secret.png"
    secret.write_bytes(encode(noise_image(), "PNG"))
    os.symlink(secret, allowed / "link.png")
    policy = MediaPolicy(allowed_local_media_path=str(allowed))
    for url in (secret.as_uri(), (allowed / "link.png").as_uri(), f"file://{allowed}/../secret.png"):
        assert "outside --allowed-local-media-path" in (await refused(url, policy)).message
    assert "names host" in (await refused(f"file://otherhost{secret}", policy)).message


async def test_file_url_that_is_missing_or_not_a_file_is_refused(tmp_path):
    policy = MediaPolicy(allowed_local_media_path=str(tmp_path))
    assert "does not exist" in (await refused((tmp_path / "nope.png").as_uri(), policy)).message
    (tmp_path / "dir").mkdir()
    assert "not a regular file" in (await refused((tmp_path / "dir").as_uri(), policy)).message
    os.mkfifo(tmp_path / "fifo")
    assert "not a regular file" in (await refused((tmp_path / "fifo").as_uri(), policy)).message


async def test_file_url_over_the_byte_limit_is_refused(tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(encode(noise_image(), "PNG"))
    policy = MediaPolicy(allowed_local_media_path=str(tmp_path), max_image_bytes=10)
    assert "too large" in (await refused(path.as_uri(), policy)).message
