"""Anthropic's official SDK, unchanged, against the real cluster and model: greedy text through Messages equals
chat completions' for the same conversation (create, stream, stop sequences, a tool loop), a forced tool call's
input validates against its schema, count_tokens is the prompt's length, and the SDK's exception types come out
for a bad request, a wrong key and an overloaded engine."""

from __future__ import annotations

import concurrent.futures
import json

import anthropic
import jsonschema
import openai
import pytest

from tests.integration.cluster import Cluster

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 24
GREEDY = {"temperature": 0}   # this SDK version takes sampling only in the body
SYSTEM = "You are a terse assistant."
ASK = [{"role": "user", "content": "Name three primary colors."}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                             "unit": {"type": "string", "enum": ["c", "f"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}


def messages_client(cluster, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=cluster.base_url, api_key=api_key, max_retries=0, timeout=120)


def chat_text(cluster, messages, max_tokens: int = MAX_TOKENS, **kwargs) -> str:
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens,
                                       **kwargs)
    return r.choices[0].message.content


def test_create_with_system_equals_chat_completions(cluster):
    m = messages_client(cluster).messages.create(model=MODEL, max_tokens=MAX_TOKENS, extra_body=GREEDY,
                                                 system=SYSTEM, messages=ASK)
    assert m.content[0].text == chat_text(cluster, [{"role": "system", "content": SYSTEM}, *ASK])
    assert m.stop_reason in ("end_turn", "max_tokens")
    counted = messages_client(cluster).messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_stream_equals_chat_completions(cluster):
    with messages_client(cluster).messages.stream(model=MODEL, max_tokens=MAX_TOKENS, extra_body=GREEDY,
                                                  messages=ASK) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text == chat_text(cluster, ASK)


def test_stop_sequence_cuts_the_greedy_text(cluster):
    full = chat_text(cluster, ASK)
    words = full.split()
    stop = words[len(words) // 2]
    m = messages_client(cluster).messages.create(model=MODEL, max_tokens=MAX_TOKENS, extra_body=GREEDY,
                                                 messages=ASK,
                                                 stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == full[:full.index(stop)]


def test_forced_tool_call_streamed_validates_and_the_loop_continues(cluster):
    client = messages_client(cluster)
    ask = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    with client.messages.stream(model=MODEL, max_tokens=60, extra_body=GREEDY, messages=ask, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        call_message = stream.get_final_message()
    [call] = [b for b in call_message.content if b.type == "tool_use"]
    jsonschema.validate(call.input, WEATHER["input_schema"])
    assert call.name == "get_weather" and call_message.stop_reason == "tool_use"

    history = [*ask, {"role": "assistant", "content": [b.model_dump() for b in call_message.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": "18 degrees and sunny"}]}]
    answer = client.messages.create(model=MODEL, max_tokens=MAX_TOKENS, extra_body=GREEDY, messages=history,
                                    tools=[WEATHER])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    chat_tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                    "parameters": WEATHER["input_schema"]}}]
    chat_history = [*ask, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    if answer.stop_reason != "tool_use":
        assert answer.content[0].text == chat_text(cluster, chat_history, tools=chat_tools)


def test_bad_request_is_the_sdks_bad_request_error(cluster):
    with pytest.raises(anthropic.BadRequestError) as caught:
        messages_client(cluster).messages.create(model=MODEL, max_tokens=100_000, messages=ASK)
    assert caught.value.body["error"]["type"] == "invalid_request_error"


@pytest.fixture(scope="module")
def guarded_cluster(tmp_path_factory, model_dir):
    """An API key, and room for one running and one waiting request: a burst is refused as overloaded."""
    c = Cluster(tmp_path_factory.mktemp("guarded"), scheduler_args=["--max-num-seqs", "1", "--max-waiting", "1"],
                gateway_args=["--api-key", "k3y"])
    try:
        yield c.start()
    finally:
        c.stop()


def test_wrong_key_and_overloaded_are_the_sdks_exception_types(guarded_cluster):
    with pytest.raises(anthropic.AuthenticationError):
        messages_client(guarded_cluster, "wrong").messages.create(model=MODEL, max_tokens=4, messages=ASK)
    client = messages_client(guarded_cluster, "k3y")

    def one(_):
        try:
            return client.messages.create(model=MODEL, max_tokens=64, messages=ASK, extra_body=GREEDY)
        except anthropic.APIStatusError as err:
            return err

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    refused = [r for r in results if isinstance(r, anthropic.APIStatusError)]
    assert refused and all(r.status_code == 529 for r in refused), results
    assert all(isinstance(r, anthropic.OverloadedError) for r in refused)
    assert any(not isinstance(r, Exception) for r in results)
