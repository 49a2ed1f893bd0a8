"""Images that come with the request or from this machine: data: URLs, bare base64 (Anthropic), file: URLs."""

from __future__ import annotations

import base64
import binascii
import os
import stat

from yarl import URL

from steploop.gateway.errors import APIError, bad_request
from steploop.gateway.media.decode import MEDIA_TYPES, too_many_bytes
from steploop.gateway.media.policy import MediaPolicy


def parse_data_url(url: str, param: str | None) -> tuple[str, str | None]:
    """`data:[<media type>][;params];base64,<data>` -> (base64 text, media type or None)."""
    header, comma, data = url[len("data:"):].partition(",")
    if not comma:
        raise bad_request("image data: URL has no ',' before its data", param=param, code="invalid_image_url")
    fields = [f.strip().lower() for f in header.split(";")]
    if "base64" not in fields[1:]:
        raise bad_request("image data: URL must be base64-encoded (data:image/png;base64,...)", param=param,
                          code="invalid_image_url")
    media_type = fields[0] or None
    if media_type is not None and not media_type.startswith("image/"):
        raise bad_request(f"image data: URL has media type {media_type}, not an image", param=param,
                          code="invalid_image_url")
    return data, media_type


def expected_format(media_type: str | None, source: str, param: str | None) -> str | None:
    """The PIL format a declared media type names (None: not declared); an image type we do not decode is a 400."""
    if media_type is None:
        return None
    fmt = MEDIA_TYPES.get(media_type.strip().lower())
    if fmt is None:
        raise bad_request(f"image from {source} has unsupported media type {media_type}; supported: "
                          f"{', '.join(sorted(MEDIA_TYPES))}", param=param, code="unsupported_image_format")
    return fmt


def decode_base64(data: str, policy: MediaPolicy, source: str, param: str | None) -> bytes:
    """Strict base64 (whitespace allowed), its size checked before decoding."""
    if not isinstance(data, str):
        raise bad_request(f"image from {source}: base64 data must be a string", param=param, code="invalid_base64")
    decoded_size = len(data) * 3 // 4 - data[-2:].count("=")      # an upper bound while whitespace is in it
    if decoded_size > policy.max_image_bytes:
        text = "".join(data.split())
        decoded_size = len(text) * 3 // 4 - text[-2:].count("=")
        if decoded_size > policy.max_image_bytes:
            raise too_many_bytes(source, decoded_size, policy, param)
    try:
        try:
            return base64.b64decode(data, validate=True)
        except binascii.Error:
            if not any(c.isspace() for c in data):
                raise
            return base64.b64decode("".join(data.split()), validate=True)    # line-wrapped base64 (MIME)
    except (binascii.Error, ValueError) as exc:
        raise bad_request(f"image from {source} is not valid base64 ({exc})", param=param,
                          code="invalid_base64") from None


def read_file_url(url: str, policy: MediaPolicy, param: str | None) -> tuple[bytes, str]:
    """The bytes of a file: URL below --allowed-local-media-path (symlinks resolved first), or a 400."""
    parsed = URL(url)
    if policy.allowed_local_media_path is None:
        raise bad_request("image file: URLs are off on this server (start it with --allowed-local-media-path)",
                          param=param, code="image_url_refused")
    if parsed.host not in (None, "", "localhost"):
        raise bad_request(f"image file: URL names host {parsed.host}; only local files can be read", param=param,
                          code="image_url_refused")
    path = os.path.realpath(parsed.path)
    root = policy.allowed_local_media_path
    if os.path.commonpath([root, path]) != root:
        raise bad_request(f"image file: URL {parsed.path} is outside --allowed-local-media-path", param=param,
                          code="image_url_refused")
    return _read_limited(path, parsed.path, policy, param), f"file:{parsed.path}"


def _read_limited(path: str, shown: str, policy: MediaPolicy, param: str | None) -> bytes:
    """Opens without following a (swapped-in) symlink and without blocking on a FIFO; regular files only."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except (FileNotFoundError, NotADirectoryError):
        raise _file_error(shown, "does not exist", param) from None
    except OSError as exc:
        raise _file_error(shown, f"cannot be read ({exc.strerror})", param) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _file_error(shown, "is not a regular file", param)
        data = _read_at_most(fd, policy.max_image_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > policy.max_image_bytes:
        raise too_many_bytes(f"file:{shown}", None, policy, param)
    return data


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks, total = [], 0
    while total < limit:
        chunk = os.read(fd, min(1 << 20, limit - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def _file_error(shown: str, what: str, param: str | None) -> APIError:
    return bad_request(f"image file {shown} {what}", param=param, code="image_url_unreachable")

