"""A bench run against a tiny in-process OpenAI-style streaming server (aiohttp): counts, concurrency, JSON."""

import asyncio
import json

import pytest
from aiohttp import web

from steploop.bench import serve
from steploop.bench.client import Target
from steploop.bench.datasets import random_dataset
from steploop.bench.runner import run

TOKEN_DELAY = 0.002


class FakeServer:
    """Streams max_tokens one-word chunks (two words in the 3rd chunk), then usage and [DONE]."""

    def __init__(self):
        self.live = self.peak = self.requests = 0

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}
        self.requests += 1
        self.live += 1
        self.peak = max(self.peak, self.live)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n, i = body["max_tokens"], 0
        prompt_len = len(body["prompt"]) if isinstance(body["prompt"], list) else len(body["prompt"].split())
        while i < n:
            k = 2 if i == 2 and n - i >= 2 else 1
            await asyncio.sleep(TOKEN_DELAY * k)
            chunk = {"choices": [{"index": 0, "text": " w" * k, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            i += k
        usage = {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        self.live -= 1
        return resp

    async def models(self, request):
        return web.json_response({"data": [{"id": "fake-model"}]})


@pytest.fixture
async def fake():
    server = FakeServer()
    app = web.Application()
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_get("/v1/models", server.models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    yield server
    await runner.cleanup()


async def test_run_counts_and_concurrency_cap(fake):
    reqs = random_dataset(12, 20, 6, seed=0)
    summary, results = await run(Target(fake.url, "fake-model"), reqs, max_concurrency=3, progress=False,
                                 warmups=random_dataset(2, 5, 2, seed=9))
    assert fake.requests == 14 and fake.peak == 3
    assert summary["completed"] == 12 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 72 and summary["total_input_tokens"] == 240
    assert all(len(r.itl) == 5 for r in results)               # 6 tokens -> 5 gaps, the 2-token chunk spread
    assert summary["mean_ttft_ms"] > 0 and summary["mean_tpot_ms"] >= TOKEN_DELAY * 1000 * 0.9


async def test_cli_writes_json_result(fake, tmp_path):
    out = await serve.bench(serve.build_parser().parse_args([
        "--base-url", fake.url, "--dataset", "random", "--random-input-len", "8", "--random-output-len", "4",
        "--num-prompts", "5", "--request-rate", "200,inf", "--goodput", "ttft:10000", "--disable-tqdm",
        "--tokenizer", str(tmp_path / "none"), "--result-dir", str(tmp_path), "--result-filename", "r.json",
        "--no-plots"]))
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["model"] == "fake-model" and saved == json.loads(json.dumps(out))
    assert [r["request_rate"] for r in saved["runs"]] == [200.0, float("inf")]
    for r in saved["runs"]:
        assert r["completed"] == 5 and r["total_output_tokens"] == 20 and r["request_goodput"] > 0
