"""http(s) image URLs, fetched with bytes, time and redirect limits and no server-side request forgery.

Every hop (the URL and each redirect target) is checked before it is requested: scheme, the --allowed-media-domains
list, and the addresses its host resolves to. The check runs inside aiohttp's connector, as its resolver: the
addresses it approves are the very ones the socket connects to, so a DNS answer that changes between check and
connect (rebinding) has nothing to change. IP literals never reach a resolver, so they are checked here first.
"""

from __future__ import annotations

import asyncio
import socket

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver
from yarl import URL

from steploop.gateway.errors import APIError, bad_request
from steploop.gateway.media.addresses import parse_ip, refusal_reason
from steploop.gateway.media.decode import too_many_bytes
from steploop.gateway.media.policy import MediaPolicy

REDIRECT_STATUSES = (301, 302, 303, 307, 308)
CHUNK_BYTES = 64 * 1024


class RefusedAddress(OSError):
    """A host resolved to an address image URLs may not reach (an OSError: aiohttp passes those through)."""


class CheckedResolver(AbstractResolver):
    """Resolves with `inner`, then refuses the host unless every address is public or the host is allow-listed."""

    def __init__(self, policy: MediaPolicy, inner: AbstractResolver | None = None) -> None:
        self.policy = policy
        self.inner = inner or ThreadedResolver()

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        results = await self.inner.resolve(host, port, family)
        if not self.policy.domain_allowed(host):
            for result in results:
                addr = parse_ip(result["host"])
                reason = refusal_reason(addr) if addr is not None else "not an IP address"
                if reason is not None:
                    raise RefusedAddress(f"host {host} resolves to {result['host']}, {reason}")
        return results

    async def close(self) -> None:
        await self.inner.close()


def describe(url: URL) -> str:
    """The URL without query, fragment or credentials, shortened: safe to log and to show."""
    bare = url.with_query(None).with_fragment(None)
    text = str(bare.with_user(None) if bare.absolute else bare)
    return text if len(text) <= 96 else text[:93] + "..."


def check_hop(url: URL, policy: MediaPolicy, param: str | None) -> None:
    """Refuses a URL before any request: scheme, allow-list, and IP-literal hosts (resolved ones: CheckedResolver)."""
    if url.scheme not in ("http", "https"):
        raise bad_request(f"image URL {describe(url)} has scheme {url.scheme or '(none)'!r}; only http, https, data "
                          f"and file (with --allowed-local-media-path) are supported", param=param,
                          code="invalid_image_url")
    host = url.raw_host
    if not host:
        raise bad_request(f"image URL {describe(url)} has no host", param=param, code="invalid_image_url")
    if policy.domain_allowed(host):
        return
    if policy.allowed_media_domains:
        raise bad_request(f"image URL host {host} is not in --allowed-media-domains", param=param,
                          code="image_url_refused")
    addr = parse_ip(host)
    reason = refusal_reason(addr) if addr is not None else None
    if reason is not None:
        raise refused(url, f"{host} is {reason}", param)


def refused(url: URL, why: str, param: str | None) -> APIError:
    return bad_request(f"image URL {describe(url)} is refused: {why}; the gateway fetches only public addresses "
                       f"unless --allowed-media-domains names the host", param=param, code="image_url_refused")


async def fetch_image_bytes(url: str, policy: MediaPolicy, *, param: str | None = None,
                            resolver: AbstractResolver | None = None) -> tuple[bytes, str]:
    """The body of an http(s) image URL and a description of where it came from, or a 400 saying why not."""
    try:
        start = URL(url)
    except (ValueError, TypeError) as exc:
        raise bad_request(f"image URL is malformed: {exc}", param=param, code="invalid_image_url") from None
    connector = aiohttp.TCPConnector(resolver=CheckedResolver(policy, resolver), use_dns_cache=False)
    timeout = aiohttp.ClientTimeout(total=policy.fetch_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False,
                                     headers={"User-Agent": "steploop-gateway", "Accept": "image/*"}) as session:
        try:
            return await asyncio.wait_for(_follow(session, start, policy, param), policy.fetch_timeout)
        except asyncio.TimeoutError:
            raise bad_request(f"image URL {describe(start)} timed out after {policy.fetch_timeout:g} s "
                              f"(--media-fetch-timeout)", param=param, code="image_url_timeout") from None


async def _follow(session: aiohttp.ClientSession, url: URL, policy: MediaPolicy,
                  param: str | None) -> tuple[bytes, str]:
    for _hop in range(policy.max_redirects + 1):
        check_hop(url, policy, param)
        async with _get(session, url, param) as response:
            if response.status not in REDIRECT_STATUSES:
                return await _read_body(response, url, policy, param), describe(url)
            location = response.headers.get("Location")
            if not location:
                raise bad_request(f"image URL {describe(url)} answered HTTP {response.status} without a Location",
                                  param=param, code="image_url_unreachable")
            try:
                url = url.join(URL(location))
            except ValueError:
                raise bad_request(f"image URL {describe(url)} redirected to a malformed URL", param=param,
                                  code="image_url_unreachable") from None
    raise bad_request(f"image URL redirected more than {policy.max_redirects} times (--max-media-redirects); "
                      f"last: {describe(url)}", param=param, code="image_url_unreachable")


class _get:
    """session.get(url) without following redirects, its connection failures mapped to 400s."""

    def __init__(self, session: aiohttp.ClientSession, url: URL, param: str | None) -> None:
        self.session, self.url, self.param = session, url, param
        self.response: aiohttp.ClientResponse | None = None

    async def __aenter__(self) -> aiohttp.ClientResponse:
        try:
            self.response = await self.session.get(self.url, allow_redirects=False)
        except asyncio.TimeoutError:
            raise                                  # the caller's deadline; aiohttp's timeouts are ClientErrors too
        except aiohttp.ClientConnectorError as exc:
            raise _connect_error(self.url, exc, self.param) from None
        except aiohttp.ClientError as exc:
            raise bad_request(f"image URL {describe(self.url)} is unreachable: {exc}", param=self.param,
                              code="image_url_unreachable") from None
        return self.response

    async def __aexit__(self, *exc_info) -> None:
        if self.response is not None:
            self.response.release()


def _connect_error(url: URL, exc: aiohttp.ClientConnectorError, param: str | None) -> APIError:
    cause = exc.os_error
    if isinstance(cause, RefusedAddress):
        return refused(url, str(cause), param)
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return bad_request(f"image URL {describe(url)} is unreachable: its host {url.raw_host} does not resolve",
                           param=param, code="image_url_unreachable")
    return bad_request(f"image URL {describe(url)} is unreachable: {cause.strerror or cause}", param=param,
                       code="image_url_unreachable")


async def _read_body(response: aiohttp.ClientResponse, url: URL, policy: MediaPolicy, param: str | None) -> bytes:
    if response.status != 200:
        raise bad_request(f"image URL {describe(url)} answered HTTP {response.status}", param=param,
                          code="image_url_unreachable")
    declared = response.content_length
    if declared is not None and declared > policy.max_image_bytes:
        raise too_many_bytes(describe(url), declared, policy, param)
    body = bytearray()
    try:
        async for chunk in response.content.iter_chunked(CHUNK_BYTES):
            body += chunk
            if len(body) > policy.max_image_bytes:
                raise too_many_bytes(describe(url), None, policy, param)
    except asyncio.TimeoutError:
        raise
    except aiohttp.ClientError as exc:
        raise bad_request(f"image URL {describe(url)} broke off while sending the image: {exc}", param=param,
                          code="image_url_unreachable") from None
    return bytes(body)
