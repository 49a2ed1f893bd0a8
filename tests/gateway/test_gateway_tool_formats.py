"""--tool-call-parser end to end through the official SDK and the fake engine: the format the gateway reads calls
in, streamed and not, what reaches the prompt, and a Mistral-style vocabulary and template (its `[TOOL_CALLS]`
a special token, its template refusing all but 9-character call ids)."""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace

import anthropic
import openai
import pytest
import pytest_asyncio

from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.text.tokenizer import load_tokenizer
from steploop.gateway.tool_parsers import TOOL_PARSERS
from tests.gateway.conftest import SERVED_NAME, serving_app, streamed_calls
from tests.gateway.fake_engine import FakeEngine, start_fake_engine
from tests.gateway.tool_format_cases import CASES, PARIS, TOOLS, WRITE, harmony

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]

# The shape of Mistral's own templates: tools in [AVAILABLE_TOOLS], earlier calls after [TOOL_CALLS] with their
# ids, results in [TOOL_RESULTS]; a call id that is not 9 characters is refused, as mistral-common refuses it.
MISTRAL_TEMPLATE = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS][{%- for c in m.tool_calls %}"
    "{%- if c.id|length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments|tojson }}, "
    "\"id\": \"{{ c.id }}\"}{%- endfor %}]</s>"
    "{%- elif m.role == 'assistant' %}{{ m.content }}</s>"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{\"content\": {{ m.content|tojson }}, "
    "\"call_id\": \"{{ m.tool_call_id }}\"}[/TOOL_RESULTS]{%- endif %}{%- endfor %}")


@pytest.fixture(scope="module")
def mistral_tokenizer(gateway_model_dir, tokenizer):
    """The test tokenizer with `[TOOL_CALLS]` added as a special token and a Mistral-style template."""
    tok = load_tokenizer(gateway_model_dir)
    tok.hf.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tok.hf.chat_template = MISTRAL_TEMPLATE
    yield tok
    tok.close()


@pytest_asyncio.fixture
async def serve(gateway_config):
    """serve(parser, tokenizer, reply_ids) -> (openai client, fake engine), a gateway with that --tool-call-parser."""
    async with contextlib.AsyncExitStack() as stack:
        async def start(parser, tokenizer, reply_ids, reasoning_parser=None):
            engine = FakeEngine(reply_ids=reply_ids, eos_token_id=tokenizer.eos_token_id)
            server, address, _ = await start_fake_engine(engine)
            stack.push_async_callback(server.stop, None)
            config = replace(gateway_config, tool_call_parser=parser, reasoning_parser=reasoning_parser)
            url, _ = await stack.enter_async_context(serving_app(EngineClient(address), tokenizer, config))
            return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0), engine

        yield start


def text_ids(tokenizer, text):
    return tokenizer.encode_sync(text, add_special_tokens=False)


async def call_both_ways(client, **kwargs):
    """(content, [(name, arguments)], finish_reason) unstreamed, then the same streamed."""
    r = await client.chat.completions.create(model=SERVED_NAME, messages=ASK, tools=[WEATHER], **kwargs)
    message = r.choices[0].message
    whole = (message.content, [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()],
             r.choices[0].finish_reason)
    chunks = [c async for c in await client.chat.completions.create(model=SERVED_NAME, messages=ASK, tools=[WEATHER],
                                                                     stream=True, **kwargs)]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = streamed_calls(chunks)
    streamed = (content or None, [(c["name"], json.loads(c["arguments"])) for c in calls],
                chunks[-1].choices[0].finish_reason)
    return whole, streamed, [c.id for c in message.tool_calls or ()]


async def test_llama3_json_calls(serve, tokenizer):
    reply = text_ids(tokenizer, '{"name": "get_weather", "parameters": {"city": "Paris"}}') + [tokenizer.eos_token_id]
    client, engine = await serve("llama3_json", tokenizer, reply)
    whole, streamed, _ = await call_both_ways(client)
    assert whole == streamed == (None, [("get_weather", {"city": "Paris"})], "tool_calls")
    prompt = tokenizer.decode(engine.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert '"parameters": <arguments-object>' in prompt and '"name": "get_weather"' in prompt   # taught its format


async def test_llama3_json_plain_answer_is_content(serve, tokenizer):
    reply = text_ids(tokenizer, "It is sunny {probably}.") + [tokenizer.eos_token_id]
    client, _ = await serve("llama3_json", tokenizer, reply)
    whole, streamed, _ = await call_both_ways(client)
    assert whole == streamed == ("It is sunny {probably}.", [], "stop")


async def test_mistral_calls_after_a_special_token(serve, mistral_tokenizer):
    """[TOOL_CALLS] is a special token here: detokenizing with skip_special_tokens (the default) would drop it, so
    a request that may call keeps special tokens, as vLLM's mistral parser does."""
    tok = mistral_tokenizer
    marker = tok.hf.convert_tokens_to_ids("[TOOL_CALLS]")
    reply = (text_ids(tok, "Checking.") + [marker] + text_ids(tok, '[{"name": "get_weather", "arguments": '
                                                                    '{"city": "Paris"}}]') + [tok.eos_token_id])
    client, engine = await serve("mistral", tok, reply)
    whole, streamed, ids = await call_both_ways(client)
    assert whole == streamed == ("Checking.", [("get_weather", {"city": "Paris"})], "tool_calls")
    assert all(len(i) == 9 and i.isalnum() for i in ids)          # ids Mistral's templates accept
    prompt = tok.decode(engine.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert prompt.startswith("[AVAILABLE_TOOLS]") and '"get_weather"' in prompt   # the template's own rendering


async def test_mistral_template_gets_nine_character_ids_for_a_clients_calls(serve, mistral_tokenizer):
    tok = mistral_tokenizer
    client, engine = await serve("mistral", tok, text_ids(tok, "21 degrees.") + [tok.eos_token_id])
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0123456789abcdef", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "21"}]
    r = await client.chat.completions.create(model=SERVED_NAME, messages=turns, tools=[WEATHER])
    assert r.choices[0].message.content == "21 degrees." and r.choices[0].finish_reason == "stop"
    prompt = tok.decode(engine.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert '"id": "789abcdef"' in prompt and '"call_id": "789abcdef"' in prompt


async def test_tool_choice_none_keeps_skipping_special_tokens(serve, mistral_tokenizer):
    tok = mistral_tokenizer
    marker = tok.hf.convert_tokens_to_ids("[TOOL_CALLS]")
    client, _ = await serve("mistral", tok, text_ids(tok, "Hi") + [marker] + text_ids(tok, "!") + [tok.eos_token_id])
    r = await client.chat.completions.create(model=SERVED_NAME, messages=ASK, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.content == "Hi!"     # no tools in play: special tokens are skipped as usual


def _case_with_calls(parser: str) -> tuple[str, str | None, list]:
    """The parser's richest conformance case: the most calls, content if any."""
    return max(CASES[parser], key=lambda case: (len(case[2]), case[1] is not None))


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
async def test_sdk_stream_assembles_to_the_unstreamed_reply(serve, tokenizer, parser):
    """The openai SDK's own stream helper (chat.completions.stream) assembles the streamed deltas into the same
    message as the unstreamed reply, for every format."""
    reply, content, calls = _case_with_calls(parser)
    client, _ = await serve(parser, tokenizer, text_ids(tokenizer, reply) + [tokenizer.eos_token_id])
    r = await client.chat.completions.create(model=SERVED_NAME, messages=ASK, tools=TOOLS)
    async with client.chat.completions.stream(model=SERVED_NAME, messages=ASK, tools=TOOLS) as stream:
        pieces = len([e async for e in stream if e.type == "tool_calls.function.arguments.delta"])
        final = await stream.get_final_completion()
    got = [(m.content, [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or ()],
            choice.finish_reason) for choice in (r.choices[0], final.choices[0]) for m in [choice.message]]
    assert got[0] == got[1] == (content, calls, "tool_calls")
    assert pieces > len(calls)          # arguments arrived in pieces, not whole


async def test_responses_stream_function_call_arguments_in_pieces(serve, tokenizer):
    reply, _, calls = next(case for case in CASES["qwen3_coder"] if WRITE in case[2])
    client, _ = await serve("qwen3_coder", tokenizer, text_ids(tokenizer, reply) + [tokenizer.eos_token_id])
    whole = await client.responses.create(model=SERVED_NAME, input="Write it", tools=RESPONSES_TOOLS)
    async with client.responses.stream(model=SERVED_NAME, input="Write it", tools=RESPONSES_TOOLS) as stream:
        deltas = [e async for e in stream if e.type == "response.function_call_arguments.delta"]
        final = await stream.get_final_response()
    expected = [(name, args) for name, args in calls]
    for response in (whole, final):
        assert [(o.name, json.loads(o.arguments)) for o in response.output if o.type == "function_call"] == expected
    assert len(deltas) > 10


async def test_messages_stream_tool_input_in_pieces(serve, tokenizer):
    """Anthropic's Messages stream carries the same call as input_json_delta pieces, assembled by its own SDK."""
    reply, _, calls = next(case for case in CASES["glm45"] if WRITE in case[2])
    client, _ = await serve("glm45", tokenizer, text_ids(tokenizer, reply) + [tokenizer.eos_token_id])
    messages = anthropic.AsyncAnthropic(base_url=str(client.base_url).removesuffix("/v1/"), api_key="none",
                                        max_retries=0)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    async with messages.messages.stream(model=SERVED_NAME, max_tokens=1000, messages=ASK, tools=tools) as stream:
        pieces = [e async for e in stream if e.type == "input_json"]
        final = await stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == calls
    assert len(pieces) > 10


async def test_gpt_oss_reasoning_and_calls_through_the_gateway(serve, tokenizer):
    """--reasoning-parser openai_gptoss with --tool-call-parser openai: the analysis channel is reasoning_content,
    the message to functions.get_weather a call, whole and streamed."""
    reply = "<|channel|>analysis<|message|>Need the weather.<|end|>" + harmony(PARIS)
    client, _ = await serve("openai", tokenizer, text_ids(tokenizer, reply) + [tokenizer.eos_token_id],
                            reasoning_parser="openai_gptoss")
    r = await client.chat.completions.create(model=SERVED_NAME, messages=ASK, tools=TOOLS)
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == "Need the weather." and message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [PARIS]
    chunks = [c async for c in await client.chat.completions.create(model=SERVED_NAME, messages=ASK, tools=TOOLS,
                                                                     stream=True)]
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
    assert reasoning == "Need the weather." and not any(c.choices[0].delta.content for c in chunks)
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls(chunks)] == [PARIS]
