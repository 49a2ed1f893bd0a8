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

from yarl import URL

from steploop.common import envs

DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024     # OpenAI's own per-image limit
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096         # a 12 MP phone photo fits; a decompression bomb does not
DEFAULT_FETCH_TIMEOUT = 5.0                    # vLLM's VLLM_IMAGE_FETCH_TIMEOUT
DEFAULT_MAX_REDIRECTS = 5
DEFAULT_MAX_IMAGES_PER_PROMPT = 16               # each costs encoder work and hundreds of prompt tokens


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
    max_images_per_prompt: int = DEFAULT_MAX_IMAGES_PER_PROMPT   # --limit-mm-per-prompt's "image"; 0: images refused

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_media_domains",
                           tuple(normalize_host(d) for d in self.allowed_media_domains if d.strip()))
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
        if self.max_images_per_prompt < 0:
            raise ValueError(f"--limit-mm-per-prompt image must be >= 0, got {self.max_images_per_prompt}")
        if self.max_redirects < 0:
            raise ValueError(f"--max-media-redirects must be >= 0 (0: redirects refused), got {self.max_redirects}")

    def domain_allowed(self, host: str) -> bool:
        """Whether `host` (a URL's raw host) is named by --allowed-media-domains (False when the list is empty)."""
        return bool(self.allowed_media_domains) and normalize_host(host) in self.allowed_media_domains

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MediaPolicy:
        return cls(allowed_media_domains=tuple(args.allowed_media_domains or ()),
                   allowed_local_media_path=args.allowed_local_media_path or None,
                   max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels,
                   fetch_timeout=args.media_fetch_timeout, max_redirects=args.max_media_redirects,
                   max_images_per_prompt=parse_limit_mm_per_prompt(args.limit_mm_per_prompt))


def parse_limit_mm_per_prompt(text: str | None) -> int:
    """vLLM's `--limit-mm-per-prompt`: JSON ({"image": 4, "video": 0}) or image=4,video=0 -> images allowed.
    Images are the only modality served: a non-zero limit for another is refused rather than silently dropped."""
    if text is None or not text.strip():
        return DEFAULT_MAX_IMAGES_PER_PROMPT
    try:
        if text.lstrip().startswith("{"):
            limits = json.loads(text)
        else:
            limits = {k.strip(): v for k, _, v in (item.partition("=") for item in text.split(",") if item.strip())}
        limits = {str(k): int(v) for k, v in limits.items()}
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"--limit-mm-per-prompt must be JSON like '{{\"image\": 4}}' or image=4, got {text!r} "
                         f"({exc})") from None
    others = {k: v for k, v in limits.items() if k != "image" and v != 0}
    if others:
        raise ValueError(f"--limit-mm-per-prompt: only images are served; {others} cannot be (give 0 or leave out)")
    return limits.get("image", DEFAULT_MAX_IMAGES_PER_PROMPT)


def normalize_host(host: str) -> str:
    """A host as URLs carry it: lower case, IDNA (bücher.example -> xn--bcher-kva.example), no brackets or final dot."""
    host = host.strip().strip("[]").rstrip(".")
    try:
        return URL.build(scheme="http", host=host).raw_host or host.lower()
    except ValueError as exc:
        raise ValueError(f"--allowed-media-domains: {host!r} is not a host name or IP address ({exc})") from None


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
    envs.add_flag(parser, "--limit-mm-per-prompt", default=None,
                  help="as vLLM's flag: images one request may carry, as JSON '{\"image\": 4}' or image=4; more is "
                       f"refused with 400; 0: no images (default image={DEFAULT_MAX_IMAGES_PER_PROMPT})")
    envs.add_flag(parser, "--max-media-redirects", type=int, default=d.max_redirects,
                  help="redirects followed when fetching an image URL, each hop checked again; 0: none")
