"""Disconnects abort, health is readiness, shutdown drains, and the gateway never loads torch or triton."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys

import aiohttp
import pytest
from grpc_health.v1 import health_pb2

from tests.gateway.conftest import SERVED_NAME, wait_for
from tests.gateway.fake_engine import FakeEngine, start_fake_engine

CHAT = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def test_client_disconnect_mid_stream_cancels_engine_call(gateway):
    gateway.engine.token_delay_s = 0.05
    gateway.engine.reply_fn = lambda req: [100 + i for i in range(200)]   # long, no EOS
    async with aiohttp.ClientSession() as http:
        resp = await http.post(f"{gateway.url}/v1/chat/completions", json=CHAT)
        assert resp.status == 200
        first = await resp.content.readline()
        assert first.startswith(b"data: ")
        resp.close()   # drop the connection mid-stream
    await wait_for(lambda: len(gateway.engine.cancelled) == 1)
    assert gateway.engine.finished == []


async def test_health_needs_serving_and_a_worker(gateway):
    async with aiohttp.ClientSession() as http:
        await until_health(http, gateway.url, 200)
        gateway.engine.num_workers = 0
        await until_health(http, gateway.url, 503)
        gateway.engine.num_workers = 1
        await until_health(http, gateway.url, 200)
        await gateway.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await until_health(http, gateway.url, 503)
        await gateway.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await until_health(http, gateway.url, 200)


async def until_health(http, url: str, status: int, timeout: float = 10.0) -> None:
    """Polls /health until it answers `status` (the gateway caches the engine's state briefly, so a change shows a
    moment later)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        async with http.get(f"{url}/health") as resp:
            if resp.status == status:
                return
        assert asyncio.get_running_loop().time() < deadline, f"/health never answered {status} in {timeout} s"
        await asyncio.sleep(0.05)      # a poll interval


NO_TORCH = """
import sys
import steploop.gateway.server
from steploop.gateway.text.tokenizer import load_tokenizer
tok = load_tokenizer(sys.argv[1])
assert tok.chat_sync([{"role": "user", "content": "hi"}])
print(",".join(sorted(m for m in ("torch", "triton") if m in sys.modules)) or "clean")
"""


def test_gateway_and_tokenizer_never_import_torch(gateway_model_dir):
    env = {k: v for k, v in os.environ.items() if k not in ("USE_TORCH", "USE_TF")}
    out = subprocess.run([sys.executable, "-c", NO_TORCH, str(gateway_model_dir)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "clean"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def gateway_process(gateway_model_dir, engine: FakeEngine, shutdown_timeout: float):
    """A real gateway process in front of `engine`, ready: (base url, process, the engine's gRPC server). Killed if a
    test leaves it up."""
    server, address, _ = await start_fake_engine(engine)
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "steploop.gateway", "--port", str(port), "--scheduler-address", address,
        "--model", str(gateway_model_dir), "--served-model-name", SERVED_NAME,
        "--shutdown-timeout", str(shutdown_timeout), stderr=asyncio.subprocess.PIPE)
    try:
        async with aiohttp.ClientSession() as http:
            await wait_for_http(http, f"http://127.0.0.1:{port}/health", proc)
        yield f"http://127.0.0.1:{port}", proc, server
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await server.stop(None)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")
async def test_sigterm_drains_in_flight_stream(gateway_model_dir, reply_ids):
    engine = FakeEngine(reply_ids=reply_ids, eos_token_id=reply_ids[-1], token_delay_s=0.05)
    async with gateway_process(gateway_model_dir, engine, shutdown_timeout=10) as (url, proc, _):
        async with aiohttp.ClientSession() as http:
            resp = await http.post(f"{url}/v1/chat/completions", json=CHAT)
            await resp.content.readline()
            proc.send_signal(signal.SIGTERM)
            # While the stream drains the socket stays open: health says not ready, new requests get a clear 503.
            async with aiohttp.ClientSession() as fresh:
                await until_health(fresh, url, 503)                 # the gateway got the signal
                async with fresh.post(f"{url}/v1/chat/completions", json=CHAT) as refused:
                    assert refused.status == 503 and refused.headers["Retry-After"] == "1"
                    assert (await refused.json())["error"]["code"] == "shutting_down"
            body = (await resp.read()).decode()
            assert body.rstrip().endswith("data: [DONE]") and '"finish_reason":"stop"' in body
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        assert engine.finished and not engine.cancelled


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")
async def test_sigterm_cancels_what_outlives_the_shutdown_timeout(gateway_model_dir, reply_ids):
    """A stream longer than --shutdown-timeout is cut (its engine request aborted) and the gateway exits; the
    stream ends with a shutting_down error event and [DONE], never a bare cut connection."""
    engine = FakeEngine(reply_ids=reply_ids, eos_token_id=reply_ids[-1], token_delay_s=1.0)
    async with gateway_process(gateway_model_dir, engine, shutdown_timeout=1) as (url, proc, _):
        async with aiohttp.ClientSession() as http:
            resp = await http.post(f"{url}/v1/chat/completions", json=CHAT)
            await resp.content.readline()
            started = asyncio.get_running_loop().time()
            proc.send_signal(signal.SIGTERM)
            events = [line[len("data: "):] for line in (await asyncio.wait_for(resp.read(), 15)).decode().splitlines()
                      if line.startswith("data: ")]
            assert await asyncio.wait_for(proc.wait(), 15) == 0
            assert asyncio.get_running_loop().time() - started < 6
        assert events[-1] == "[DONE]", events
        error = json.loads(events[-2])["error"]
        assert error["code"] == "shutting_down" and "--shutdown-timeout 1 s" in error["message"], error
        await wait_for(lambda: engine.cancelled)     # the request was aborted, not left generating
        assert not engine.finished


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")
async def test_a_messages_stream_cut_by_the_deadline_ends_with_an_error_event(gateway_model_dir, reply_ids):
    """Anthropic's stream (no [DONE] there) ends with its own `error` event naming the shutdown."""
    engine = FakeEngine(reply_ids=reply_ids, eos_token_id=reply_ids[-1], token_delay_s=1.0)
    body = {"model": SERVED_NAME, "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with gateway_process(gateway_model_dir, engine, shutdown_timeout=1) as (url, proc, _):
        async with aiohttp.ClientSession() as http:
            resp = await http.post(f"{url}/v1/messages", json=body)
            await resp.content.readline()
            proc.send_signal(signal.SIGTERM)
            text = (await asyncio.wait_for(resp.read(), 15)).decode()
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    last = text.strip().split("\n\n")[-1]
    assert last.startswith("event: error\n"), text[-500:]
    assert "the server is shutting down" in last and "--shutdown-timeout 1 s" in last, last


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")
async def test_a_request_cut_before_its_first_token_is_a_503(gateway_model_dir, reply_ids):
    engine = FakeEngine(reply_ids=reply_ids, eos_token_id=reply_ids[-1], token_delay_s=30.0)
    async with gateway_process(gateway_model_dir, engine, shutdown_timeout=1) as (url, proc, _):
        async with aiohttp.ClientSession() as http:
            pending = asyncio.ensure_future(http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": False}))
            await wait_for(lambda: engine.requests)
            proc.send_signal(signal.SIGTERM)
            async with await pending as resp:
                assert resp.status == 503 and (await resp.json())["error"]["code"] == "shutting_down"
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        await wait_for(lambda: engine.cancelled)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")
async def test_engine_stopping_during_the_drain_is_a_503_in_words(gateway_model_dir, reply_ids):
    """Ctrl-C under `steploop serve` stops gateway and scheduler together: a request still waiting for its first
    token when the scheduler's grace ends gets a 503 that says the engine stopped, never gRPC's "Cancelling all
    calls"; the gateway still refuses new work with shutting_down and exits cleanly."""
    engine = FakeEngine(reply_ids=reply_ids, eos_token_id=reply_ids[-1], token_delay_s=30.0)
    async with gateway_process(gateway_model_dir, engine, shutdown_timeout=10) as (url, proc, server):
        async with aiohttp.ClientSession() as http:
            pending = asyncio.ensure_future(http.post(f"{url}/v1/chat/completions", json=CHAT))
            await wait_for(lambda: engine.requests)
            proc.send_signal(signal.SIGTERM)
            async with aiohttp.ClientSession() as fresh:
                await until_health(fresh, url, 503)                 # the gateway got the signal
                async with fresh.post(f"{url}/v1/chat/completions", json=CHAT) as refused:
                    assert refused.status == 503 and (await refused.json())["error"]["code"] == "shutting_down"
            await server.stop(0.1)                       # the scheduler's own drain ends with the call still open
            async with await pending as resp:
                assert resp.status == 503 and resp.headers["Retry-After"] == "1"
                error = (await resp.json())["error"]
        assert error["code"] == "engine_unavailable" and "Cancelling" not in error["message"]
        assert "the engine stopped before this request finished" in error["message"]
        assert await asyncio.wait_for(proc.wait(), 15) == 0


async def wait_for_http(http, url, proc, timeout=60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        assert proc.returncode is None, (await proc.stderr.read()).decode()[-2000:]
        try:
            async with http.get(url) as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"{url} not ready")



@pytest.mark.parametrize("address", ["127.0.0.1:1,127.0.0.1:1", "", ","])
def test_a_bad_scheduler_address_is_a_usage_error(address):
    out = subprocess.run([sys.executable, "-m", "steploop.gateway", "--scheduler-address", address],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "--scheduler-address" in out.stderr and "Traceback" not in out.stderr
