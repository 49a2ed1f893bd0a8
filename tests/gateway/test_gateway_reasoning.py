"""--reasoning-parser: the <think>…</think> split, fed whole and piece by piece, and how each API returns it
(chat's reasoning_content, Messages' thinking blocks, Responses' reasoning items), against the fake engine."""

from __future__ import annotations

from dataclasses import replace

import anthropic
import pytest

from steploop.gateway.config import GatewayConfig
from steploop.gateway.text.reasoning import ReasoningSplitter, get_reasoning_parser
from tests.gateway.conftest import SERVED_NAME

REPLY = "<think>\nThe user greets me. 2 < 3.\n</think>\n\nHello! The end."
THINKING, ANSWER = "\nThe user greets me. 2 < 3.\n", "Hello! The end."
ASK = [{"role": "user", "content": "Hi"}]


def split(parser_name: str, text: str, piece: int) -> tuple[str, str]:
    splitter = ReasoningSplitter(get_reasoning_parser(parser_name))
    reasoning = content = ""
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)] or [""]
    for i, delta in enumerate(pieces):
        r, c = splitter.feed(delta, last=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_split_does_not_depend_on_how_the_text_arrives(parser, piece):
    assert split(parser, REPLY, piece) == (THINKING, ANSWER)
    assert split(parser, "No thinking here.", piece) == (("No thinking here.", "") if parser == "deepseek_r1"
                                                         else ("", "No thinking here."))
    assert split(parser, "<think>cut while thin", piece) == ("cut while thin", "")
    assert split(parser, "<thi", piece) == (("<thi", "") if parser == "deepseek_r1" else ("", "<thi"))


def test_deepseek_form_without_the_opening_tag():
    assert split("deepseek_r1", "I should greet.</think>Hello!", 2) == ("I should greet.", "Hello!")


def test_unknown_parser_refused_at_start():
    with pytest.raises(ValueError, match="--reasoning-parser must be one of"):
        GatewayConfig(reasoning_parser="nope")


@pytest.fixture
def gateway_config(gateway_config):
    return replace(gateway_config, reasoning_parser="qwen3")


@pytest.fixture
def fake_engine(fake_engine, tokenizer):
    fake_engine.reply_ids = tokenizer.encode_sync(REPLY, add_special_tokens=False) + [tokenizer.eos_token_id]
    return fake_engine


async def test_chat_reasoning_content(gateway):
    r = await gateway.openai().chat.completions.create(model=SERVED_NAME, messages=ASK)
    message = r.choices[0].message
    assert message.content == ANSWER and message.model_extra["reasoning_content"] == THINKING
    assert r.usage.completion_tokens == len(gateway.engine.reply_ids)   # max_tokens counts both
    stream = await gateway.openai().chat.completions.create(model=SERVED_NAME, messages=ASK, stream=True)
    chunks = [c async for c in stream]
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (reasoning, content) == (THINKING, ANSWER)


async def test_messages_thinking_block(gateway):
    c = anthropic.AsyncAnthropic(base_url=gateway.url, api_key="none", max_retries=0)
    m = await c.messages.create(model=SERVED_NAME, max_tokens=100, messages=ASK)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", THINKING), ("text", ANSWER)]
    async with c.messages.stream(model=SERVED_NAME, max_tokens=100, messages=ASK) as stream:
        streamed = await stream.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "text"]
    assert streamed.content[0].thinking == THINKING and streamed.content[1].text == ANSWER


async def test_responses_reasoning_item(gateway):
    r = await gateway.openai().responses.create(model=SERVED_NAME, input="Hi")
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == THINKING and r.output_text == ANSWER
    async with gateway.openai().responses.stream(model=SERVED_NAME, input="Hi") as stream:
        kinds = [e.type async for e in stream]
        final = await stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.output_text == ANSWER
