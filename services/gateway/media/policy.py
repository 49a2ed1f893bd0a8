"""MediaPolicy: what the gateway may fetch and decode for an image part, frozen at start.

The flags follow vLLM's where vLLM has one (`--allowed-media-domains`, `--allowed-local-media-path`); the limits are
steploop's own. Every limit is checked before the work it bounds: bytes before decoding, pixels (from the header)
before the pixel data is decoded, each redirect hop before it is requested.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

from steploop.common import envs

DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024     # OpenAI's own per-image limit
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096         # a 12 MP phone photo fits; a decompression bomb does not
DEFAULT_FETCH_TIMEOUT = 5.0                    # vLLM's VLLM_IMAGE_FETCH_TIMEOUT
DEFAULT_MAX_REDIRECTS = 5


@dataclass(frozen=True)
class MediaPolicy:
    # Hosts (exact names or IP literals, lower case) image URLs may name. Empty: any host whose addresses are all
    # public. Non-empty: only these hosts (vLLM's meaning), and they may resolve to private or loopback addresses.
    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str | None = None    # file: URLs only below this folder; None: file: URLs refused
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES    # encoded size of one image (fetched, base64-decoded or read)
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # width * height of one image, read from its header
    fetch_timeout: float = DEFAULT_FETCH_TIMEOUT      # seconds for one URL, all redirects and the body included
    max_redirects: int = DEFAULT_MAX_REDIRECTS        # hops followed, each re-checked; one more is refused

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_media_domains",
                           tuple(d.strip().lower().rstrip(".") for d in self.allowed_media_domains if d.strip()))
        if self.allowed_local_media_path is not None:
            if not os.path.isdir(self.allowed_local_media_path):
                raise ValueError(f"--allowed-local-media-path must be an existing folder, got "
                                 f"{self.allowed_local_media_path!r}")
            object.__setattr__(self, "allowed_local_media_path", os.path.realpath(self.allowed_local_media_path))
        for name in ("max_image_bytes", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.fetch_timeout <= 0:
            raise ValueError(f"--media-fetch-timeout must be > 0 seconds, got {self.fetch_timeout}")
        if self.max_redirects < 0:
            raise ValueError(f"--max-media-redirects must be >= 0 (0: redirects refused), got {self.max_redirects}")

    def domain_allowed(self, host: str) -> bool:
        """Whether `host` is named by --allowed-media-domains (False when the list is empty)."""
        return host.lower().rstrip(".") in self.allowed_media_domains

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MediaPolicy:
        return cls(allowed_media_domains=tuple(args.allowed_media_domains or ()),
                   allowed_local_media_path=args.allowed_local_media_path or None,
                   max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels,
                   fetch_timeout=args.media_fetch_timeout, max_redirects=args.max_media_redirects)


def _domains_from_env() -> list[str] | None:
    """STEPLOOP_ALLOWED_MEDIA_DOMAINS: a JSON list (what `steploop serve` writes) or names separated by spaces."""
    raw = os.environ.get(envs.env_name("--allowed-media-domains"))
    if not raw:
        return None
    return [str(d) for d in json.loads(raw)] if raw.lstrip().startswith("[") else raw.split()


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    d = MediaPolicy()
    parser.add_argument("--allowed-media-domains", nargs="+", default=_domains_from_env(),
                        help="as vLLM's flag: image URLs may name only these hosts (exact names or IP literals), and "
                             "these may resolve to private, loopback or link-local addresses; unset: any host whose "
                             "addresses are all public "
                             f"(env {envs.env_name('--allowed-media-domains')}, a JSON list)")
    envs.add_flag(parser, "--allowed-local-media-path", default=None,
                  help="as vLLM's flag: file: image URLs may read files below this folder (symlinks resolved); "
                       "unset: file: URLs are refused")
    envs.add_flag(parser, "--max-image-bytes", type=int, default=d.max_image_bytes,
                  help="an encoded image larger than this (fetched, base64 or file) is refused with 400")
    envs.add_flag(parser, "--max-image-pixels", type=int, default=d.max_image_pixels,
                  help="an image of more pixels (width x height, read from its header before decoding) is "
                       "refused with 400")
    envs.add_flag(parser, "--media-fetch-timeout", type=float, default=d.fetch_timeout,
                  help="seconds the gateway spends fetching one image URL, redirects and body included")
    envs.add_flag(parser, "--max-media-redirects", type=int, default=d.max_redirects,
                  help="redirects followed when fetching an image URL, each hop checked again; 0: none")
