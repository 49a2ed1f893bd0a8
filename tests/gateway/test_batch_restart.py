"""A gateway SIGKILLed in the middle of a batch, then started again on the same --batch-dir: the job resumes where
its journal stopped and completes with every line answered exactly once (the lines in flight at the kill, at most
--batch-concurrency, are the only ones the engine sees twice)."""

from __future__ import annotations

import asyncio
import collections
import io
import json
import os
import signal
import subprocess
import sys

import aiohttp
import openai
import pytest

from tests.gateway.conftest import SERVED_NAME
from tests.gateway.fake_engine import start_fake_engine
from tests.integration.cluster import ROOT, free_port

pytestmark = pytest.mark.slow

KEY = "user-key"
LINES, CONCURRENCY = 24, 3


def _gateway(model_dir, engine_address: str, port: int, batch_dir, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "steploop.gateway", "--model", str(model_dir),
                             "--served-model-name", SERVED_NAME, "--scheduler-address", engine_address,
                             "--port", str(port), "--api-key", KEY, "--batch-dir", str(batch_dir),
                             "--batch-concurrency", str(CONCURRENCY)],
                            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=log,
                            stderr=subprocess.STDOUT)


async def _until(check, what: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert proc.poll() is None, f"the gateway exited ({proc.returncode}) waiting for {what}"
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def _healthy(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as s, s.get(url + "/health") as resp:
            return resp.status == 200
    except aiohttp.ClientError:
        return False


async def test_sigkill_mid_batch_then_restart_answers_every_line_once(fake_engine, gateway_model_dir, tmp_path):
    fake_engine.token_delay_s = 0.04             # ~0.3 s a line
    server, address, _ = await start_fake_engine(fake_engine)
    port, batch_dir = free_port(), tmp_path / "batches"
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "gateway.log", "ab")   # noqa: SIM115, ASYNC230 - both gateway runs append to it
    proc = _gateway(gateway_model_dir, address, port, batch_dir, log)
    try:
        await _until(lambda: _healthy(url), "the gateway", proc)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                  "body": {"model": SERVED_NAME, "prompt": f"prompt number {i}", "max_tokens": 6}}
                 for i in range(LINES)]
        data = io.BytesIO("".join(json.dumps(x) + "\n" for x in lines).encode())
        data.name = "in.jsonl"
        file = await client.files.create(file=data, purpose="batch")
        batch = await client.batches.create(input_file_id=file.id, endpoint="/v1/completions",
                                            completion_window="24h")

        async def some_done() -> bool:
            return (await client.batches.retrieve(batch.id)).request_counts.completed >= 6
        await _until(some_done, "a few lines done", proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        journal = [json.loads(x) for x in (batch_dir / "batches" / f"{batch.id}.journal").read_text().splitlines()]
        assert 6 <= len(journal) < LINES, "the kill was not mid-batch"
        sent_before = len(fake_engine.requests)

        proc = _gateway(gateway_model_dir, address, port, batch_dir, log)
        await _until(lambda: _healthy(url), "the restarted gateway", proc)

        async def finished() -> bool:
            return (await client.batches.retrieve(batch.id)).status == "completed"
        await _until(finished, "the batch to complete after the restart", proc)
        done = await client.batches.retrieve(batch.id)
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (LINES,
                                                                                                          LINES, 0)
        output = [json.loads(x) for x in (await client.files.content(done.output_file_id)).text.splitlines()]
        assert [o["custom_id"] for o in output] == [f"line-{i}" for i in range(LINES)]   # each exactly once
        assert all(o["response"]["status_code"] == 200 for o in output)
        # the engine saw each prompt once, except those in flight at the kill (at most --batch-concurrency)
        seen = collections.Counter(tuple(r.prompt_token_ids) for r in fake_engine.requests)
        assert len(seen) == LINES and sum(seen.values()) - LINES <= CONCURRENCY
        assert len(fake_engine.requests) - sent_before >= LINES - len(journal)   # the rest ran after the restart
        resumed_journal = (batch_dir / "batches" / f"{batch.id}.journal").read_text().splitlines()
        assert sorted(json.loads(x)["line"] for x in resumed_journal) == list(range(LINES))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        log.close()
        await server.stop(None)
