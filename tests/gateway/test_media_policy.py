"""MediaPolicy: its flags on `steploop gateway` and `steploop serve`, the environment, and refused values."""

from __future__ import annotations

import pytest

from steploop import serve
from steploop.gateway.config import GatewayConfig
from steploop.gateway.media import MediaPolicy
from steploop.gateway.server import build_parser


def test_defaults_refuse_file_urls_and_private_hosts():
    policy = GatewayConfig.from_args(build_parser().parse_args([])).media
    assert policy == MediaPolicy()
    assert policy.allowed_media_domains == () and policy.allowed_local_media_path is None
    assert not policy.domain_allowed("localhost")


def test_gateway_flags_reach_the_policy(tmp_path):
    args = build_parser().parse_args([
        "--allowed-media-domains", "Images.Example.com", "127.0.0.1", "--allowed-local-media-path", str(tmp_path),
        "--max-image-bytes", "1000", "--max-image-pixels", "4096", "--media-fetch-timeout", "1.5",
        "--max-media-redirects", "0"])
    policy = GatewayConfig.from_args(args).media
    assert policy.allowed_media_domains == ("images.example.com", "127.0.0.1")
    assert policy.domain_allowed("images.example.com.") and policy.domain_allowed("IMAGES.example.com")
    assert not policy.domain_allowed("sub.images.example.com")       # exact names, as vLLM's flag
    assert policy.allowed_local_media_path == str(tmp_path.resolve())
    assert (policy.max_image_bytes, policy.max_image_pixels, policy.fetch_timeout, policy.max_redirects) == \
        (1000, 4096, 1.5, 0)


def test_allowed_domains_are_compared_as_urls_carry_hosts():
    policy = MediaPolicy(allowed_media_domains=("Bücher.Example.", "[::1]"))
    assert policy.allowed_media_domains == ("xn--bcher-kva.example", "::1")
    assert policy.domain_allowed("xn--bcher-kva.example") and policy.domain_allowed("::1")
    with pytest.raises(ValueError, match="'a b' is not a host name"):
        MediaPolicy(allowed_media_domains=("a b",))


def test_serve_hands_the_domains_to_its_gateway(monkeypatch):
    parser = serve.build_parser()
    args = parser.parse_args(["--allowed-media-domains", "a.example", "b.example"])
    args.scheduler_address = serve.own_scheduler_address(args)
    env = serve.child_environment(parser, args)
    assert env["STEPLOOP_ALLOWED_MEDIA_DOMAINS"] == '["a.example", "b.example"]'
    monkeypatch.setenv("STEPLOOP_ALLOWED_MEDIA_DOMAINS", env["STEPLOOP_ALLOWED_MEDIA_DOMAINS"])
    child = GatewayConfig.from_args(build_parser().parse_args([])).media
    assert child.allowed_media_domains == ("a.example", "b.example")
    monkeypatch.setenv("STEPLOOP_ALLOWED_MEDIA_DOMAINS", "c.example d.example")     # by hand: space-separated
    assert MediaPolicy.from_args(build_parser().parse_args([])).allowed_media_domains == ("c.example", "d.example")


@pytest.mark.parametrize("text, images", [
    (None, 16), ('{"image": 4}', 4), ('{"image": 2, "video": 0}', 2), ("image=3,video=0", 3), ('{"video": 0}', 16),
    ("image=0", 0),
])
def test_limit_mm_per_prompt_takes_vllms_forms(text, images):
    argv = ["--limit-mm-per-prompt", text] if text is not None else []
    assert GatewayConfig.from_args(build_parser().parse_args(argv)).media.max_images_per_prompt == images


@pytest.mark.parametrize("text, words", [
    ('{"video": 1}', "only images are served"), ("image=many", "must be JSON like"), ('{"image": -1}', ">= 0"),
])
def test_limit_mm_per_prompt_refuses_what_it_cannot_serve(text, words):
    with pytest.raises(ValueError, match=words):
        GatewayConfig.from_args(build_parser().parse_args(["--limit-mm-per-prompt", text]))


@pytest.mark.parametrize("kwargs, words", [
    ({"max_image_bytes": 0}, "--max-image-bytes must be >= 1"),
    ({"max_image_pixels": -1}, "--max-image-pixels must be >= 1"),
    ({"fetch_timeout": 0}, "--media-fetch-timeout must be > 0"),
    ({"max_redirects": -1}, "--max-media-redirects must be >= 0"),
    ({"allowed_local_media_path": "/no/such/folder"}, "--allowed-local-media-path must be an existing folder"),
])
def test_bad_values_are_refused_at_start(kwargs, words):
    with pytest.raises(ValueError, match=words):
        MediaPolicy(**kwargs)
