"""http(s) image URLs: limits on bytes, time and redirects, and SSRF refusals that never open a connection.

A local aiohttp server on 127.0.0.1 stands for the image host (allow-listed, since loopback is refused otherwise);
a bare listening socket counts connections, to show that a refused URL never reached it.
"""

from __future__ import annotations

import asyncio
import socket
import zlib

import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.abc import AbstractResolver

from steploop.gateway.errors import APIError
from steploop.gateway.media import MediaPolicy, load_image
from tests.gateway.media_images import encode, noise_image

PARAM = "messages[0].content[0].image_url.url"
PNG = encode(noise_image(), "PNG")
LOCAL = MediaPolicy(allowed_media_domains=("127.0.0.1",), fetch_timeout=2.0, max_redirects=2)


class ImageServer:
    """Routes: /a.png, /big (chunked), /missing (404), /hang (never answers), /trickle, /redirect/<n>, /to?url=."""

    def __init__(self) -> None:
        self.release = asyncio.Event()      # set at teardown: hanging handlers return
        self.hits: list[str] = []
        self.port = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/a.png", self.image)
        app.router.add_get("/big", self.big)
        app.router.add_get("/missing", self.missing)
        app.router.add_get("/hang", self.hang)
        app.router.add_get("/trickle", self.trickle)
        app.router.add_get("/redirect/{n}", self.redirect)
        app.router.add_get("/gzip-bomb", self.gzip_bomb)
        app.router.add_get("/to", self.to)
        app.middlewares.append(self.count)
        return app

    @web.middleware
    async def count(self, request, handler):
        self.hits.append(request.path)
        return await handler(request)

    async def image(self, request):
        return web.Response(body=PNG, content_type="image/png")

    async def big(self, request):
        response = web.StreamResponse()          # chunked: no Content-Length to refuse early
        await response.prepare(request)
        for _ in range(64):
            await response.write(b"\0" * 1024)
        return response

    async def gzip_bomb(self, request):        # 64 MiB of zeros in ~64 KiB of gzip
        packer = zlib.compressobj(9, zlib.DEFLATED, 31)
        body = b"".join(packer.compress(bytes(1 << 20)) for _ in range(64)) + packer.flush()
        return web.Response(body=body, headers={"Content-Encoding": "gzip", "Content-Type": "image/bmp"})

    async def missing(self, request):
        return web.Response(status=404)

    async def to(self, request):
        return web.Response(status=302, headers={"Location": request.query["url"]})

    async def hang(self, request):
        await self.release.wait()
        return web.Response(body=PNG)

    async def trickle(self, request):
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(PNG[:10])
        await self.release.wait()
        return response

    async def redirect(self, request):        # n + 1 hops to the image
        n = int(request.match_info["n"])
        raise web.HTTPFound(f"/redirect/{n - 1}" if n > 0 else "/a.png")

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


@pytest_asyncio.fixture
async def server():
    images = ImageServer()
    runner = web.AppRunner(images.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    images.port = runner.addresses[0][1]
    yield images
    images.release.set()
    await runner.cleanup()


@pytest_asyncio.fixture
async def listener():
    """A socket on 127.0.0.1 that records every connection it accepts."""
    accepted: list[object] = []

    async def on_connect(reader, writer):
        accepted.append(writer.get_extra_info("peername"))
        writer.close()

    srv = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    srv.accepted = accepted
    srv.port = srv.sockets[0].getsockname()[1]
    yield srv
    srv.close()
    await srv.wait_closed()


class FakeDNS(AbstractResolver):
    """Answers from a table (names that do not exist anywhere), so tests choose what a name resolves to."""

    def __init__(self, table: dict[str, str]) -> None:
        self.table = table
        self.asked: list[str] = []

    async def resolve(self, host, port=0, family=socket.AF_INET):
        self.asked.append(host)
        if host not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [{"hostname": host, "host": self.table[host], "port": port, "family": socket.AF_INET, "proto": 0,
                 "flags": socket.AI_NUMERICHOST}]

    async def close(self):
        pass


async def refused(url: str, policy: MediaPolicy, **kwargs) -> APIError:
    with pytest.raises(APIError) as info:
        await load_image(url, policy, param=PARAM, **kwargs)
    assert info.value.status == 400 and info.value.param == PARAM
    return info.value


async def test_fetches_an_allow_listed_image(server):
    loaded = await load_image(server.url("/a.png"), LOCAL)
    assert loaded.size == (16, 12) and loaded.source == server.url("/a.png")
    assert server.hits == ["/a.png"]


async def test_source_hides_query_and_credentials(server):
    loaded = await load_image(server.url("/a.png?token=secret").replace("http://", "http://user:pw@"), LOCAL)
    assert "secret" not in loaded.source and "pw" not in loaded.source


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::ffff:127.0.0.1]", "0.0.0.0", "2130706433",
                                  "127.1", "0x7f.0.0.1", "LOCALHOST"])
async def test_loopback_is_refused_without_a_connection(listener, host):
    err = await refused(f"http://{host}:{listener.port}/a.png", MediaPolicy())
    assert "is refused" in err.message and "--allowed-media-domains" in err.message
    assert err.code == "image_url_refused"
    await asyncio.sleep(0)              # let a connection that did arrive be accepted before counting
    assert listener.accepted == []


async def test_the_listener_sees_a_connection_that_is_made(listener):
    """The control for the tests above: allow-listed, the same URL does connect (and the listener hangs up)."""
    err = await refused(f"http://127.0.0.1:{listener.port}/a.png", LOCAL)
    assert "unreachable" in err.message
    assert listener.accepted      # (aiohttp retries a GET once when the server hangs up at once)


@pytest.mark.parametrize("address, reason", [
    ("169.254.169.254", "link-local"), ("10.1.2.3", "private"), ("192.168.0.1", "private"),
    ("224.0.0.1", "multicast"), ("[fe80::1]", "link-local"), ("[::1]", "loopback"), ("[fc00::1]", "private"),
    ("[64:ff9b::a9fe:a9fe]", "link-local"), ("100.64.0.1", "not globally routable"),
])
async def test_private_and_metadata_addresses_are_refused(address, reason):
    dns = FakeDNS({})
    err = await refused(f"http://{address}/latest/meta-data", MediaPolicy(), resolver=dns)
    assert reason in err.message and err.code == "image_url_refused"
    assert dns.asked == []             # refused before any resolution or connection


async def test_a_name_resolving_to_a_private_address_is_refused_without_a_connection(listener):
    dns = FakeDNS({"metadata.example": "169.254.169.254", "rebind.example": "127.0.0.1"})
    err = await refused("http://metadata.example/latest", MediaPolicy(), resolver=dns)
    assert "resolves to 169.254.169.254, a link-local address" in err.message
    err = await refused(f"http://rebind.example:{listener.port}/a.png", MediaPolicy(), resolver=dns)
    assert "resolves to 127.0.0.1, a loopback address" in err.message
    await asyncio.sleep(0)
    assert listener.accepted == []


async def test_connects_to_the_address_it_checked(server):
    """The checked answer is the one connected to: a name no real DNS knows reaches the server it resolved to."""
    dns = FakeDNS({"pinned.example": "127.0.0.1"})
    policy = MediaPolicy(allowed_media_domains=("pinned.example",))
    loaded = await load_image(server.url("/a.png", host="pinned.example"), policy, resolver=dns)
    assert loaded.size == (16, 12) and dns.asked == ["pinned.example"]


async def test_allow_list_admits_only_its_hosts(server):
    err = await refused(server.url("/a.png", host="localhost"), LOCAL)
    assert "host localhost is not in --allowed-media-domains" in err.message
    assert server.hits == []


async def test_redirects_are_followed_up_to_the_limit(server):
    assert (await load_image(server.url("/redirect/1"), LOCAL)).size == (16, 12)     # two hops
    err = await refused(server.url("/redirect/2"), LOCAL)
    assert "redirected more than 2 times" in err.message
    no_redirects = MediaPolicy(allowed_media_domains=("127.0.0.1",), max_redirects=0)
    assert "redirected more than 0 times" in (await refused(server.url("/redirect/0"), no_redirects)).message


async def test_every_redirect_hop_is_checked(server, listener):
    to_other_host = server.url(f"/to?url=http://localhost:{listener.port}/a.png")
    assert "host localhost is not in --allowed-media-domains" in (await refused(to_other_host, LOCAL)).message
    to_file = server.url("/to?url=file:///etc/passwd")
    assert "scheme 'file'" in (await refused(to_file, LOCAL)).message
    dns = FakeDNS({"public.example": "127.0.0.1", "internal.example": "10.0.0.7"})
    policy = MediaPolicy(allowed_media_domains=("public.example", "127.0.0.1"))
    hop = server.url("/to?url=http://internal.example/a.png", host="public.example")
    assert "internal.example is not in --allowed-media-domains" in (await refused(hop, policy, resolver=dns)).message
    await asyncio.sleep(0)
    assert listener.accepted == [] and dns.asked == ["public.example"]


async def test_too_many_bytes_is_refused(server):
    small = MediaPolicy(allowed_media_domains=("127.0.0.1",), max_image_bytes=len(PNG) - 1)
    err = await refused(server.url("/a.png"), small)          # Content-Length says so: refused before reading
    assert f"{len(PNG)} bytes, more than the {len(PNG) - 1} allowed" in err.message
    chunked = MediaPolicy(allowed_media_domains=("127.0.0.1",), max_image_bytes=4096)
    err = await refused(server.url("/big"), chunked)
    assert "more bytes than the 4096 allowed" in err.message and err.code == "image_too_large"


async def test_compressed_body_is_limited_by_its_decoded_size(server):
    policy = MediaPolicy(allowed_media_domains=("127.0.0.1",), max_image_bytes=1 << 20)
    err = await refused(server.url("/gzip-bomb"), policy)
    assert "more bytes than the 1048576 allowed" in err.message


@pytest.mark.parametrize("path", ["/hang", "/trickle"])
async def test_slow_server_times_out(server, path):
    policy = MediaPolicy(allowed_media_domains=("127.0.0.1",), fetch_timeout=0.3)
    loop = asyncio.get_running_loop()
    started = loop.time()
    err = await refused(server.url(path), policy)
    assert "timed out after 0.3 s" in err.message and err.code == "image_url_timeout"
    assert loop.time() - started < 2.0


async def test_error_status_is_refused(server):
    assert "answered HTTP 404" in (await refused(server.url("/missing"), LOCAL)).message


async def test_unreachable_host_is_refused(listener):
    port = listener.port
    listener.close()
    await listener.wait_closed()
    err = await refused(f"http://127.0.0.1:{port}/a.png", LOCAL)
    assert "unreachable" in err.message and err.code == "image_url_unreachable"
    err = await refused("http://nowhere.example/a.png", MediaPolicy(), resolver=FakeDNS({}))
    assert "does not resolve" in err.message


async def test_malformed_url_is_refused():
    assert "has no host" in (await refused("http:///a.png", MediaPolicy())).message
