"""Every --tool-call-parser fed the same replies, cut where a real tokenizer cuts them (the default model's, through
the gateway's incremental detokenizer): 1 token per delta, k tokens (2, 3, 7) and the whole text. The content and
the calls (names and arguments) must come out identical every way and equal the expected ones; the streamed deltas
must be OpenAI's shape and assemble, through the openai SDK's own stream accumulator, to the same message."""

from __future__ import annotations

import itertools
import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from steploop.gateway.text.detokenizer import IncrementalDetokenizer
from steploop.gateway.tool_parsers import TOOL_PARSERS, CallSplitter, get_tool_parser, split_whole
from tests.gateway.tool_format_cases import CASES, COUNT, PARIS, PLAIN, SCHEMAS, WRITE

DELTA_TOKENS = [1, 2, 3, 7]
ALL = [(name, *case) for name, cases in CASES.items() for case in cases]
ALL += [(name, text, text, []) for name in sorted(TOOL_PARSERS) for text in PLAIN]


def test_every_parser_has_cases():
    assert set(CASES) == set(TOOL_PARSERS)


def new_ids():
    counter = itertools.count()
    return lambda: f"id{next(counter)}"


def token_deltas(tokenizer, text: str, k: int) -> tuple[str, list[str]]:
    """`text` as the gateway streams it, k tokens per delta: (the decoded whole, the deltas)."""
    ids = tokenizer.encode_sync(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    deltas = [detok.add(ids[i:i + k]) for i in range(0, len(ids), k)] + [detok.flush()]
    return detok.output_text, deltas


def stream(parser_name: str, deltas: list[str]) -> list[dict]:
    splitter = CallSplitter(get_tool_parser(parser_name), SCHEMAS, new_ids())
    out = [d for delta in deltas for d in splitter.feed(delta)]
    return out + splitter.finish()


def assemble(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str, str]]]:
    """The deltas as chat.completion.chunks through the openai SDK's accumulator: (content, [(id, name, args)])."""
    state = ChatCompletionStreamState()
    for delta in [{"role": "assistant"}, *deltas]:
        state.handle_chunk(ChatCompletionChunk.model_validate({
            "id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}))
    state.handle_chunk(ChatCompletionChunk.model_validate({
        "id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    message = state.get_final_completion().choices[0].message
    calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
    return message.content, calls


def check_shape(deltas: list[dict]) -> None:
    """OpenAI's streaming shape: a call's first delta has index, id, type, name and empty arguments; later ones only
    index and an arguments piece; indices count up from 0; no empty pieces."""
    begun = 0
    for delta in deltas:
        if "content" in delta:
            assert set(delta) == {"content"} and delta["content"]
            continue
        [call] = delta["tool_calls"]
        if "id" in call:
            assert call["index"] == begun and call["type"] == "function"
            assert call["function"]["arguments"] == "" and call["function"]["name"]
            begun += 1
        else:
            assert call["index"] == begun - 1 and set(call) == {"index", "function"}
            assert set(call["function"]) == {"arguments"} and call["function"]["arguments"]


@pytest.mark.parametrize("parser, reply, content, calls", ALL)
def test_same_reading_at_every_delta_size(tokenizer, parser, reply, content, calls):
    whole_text, _ = token_deltas(tokenizer, reply, 1)
    assert whole_text == reply                     # the tokenizer round-trips the case
    ids = [f"functions.{name}:{i}" if parser == "kimi_k2" else f"id{i}" for i, (name, _) in enumerate(calls)]
    want = (content, [(ids[i], name, json.dumps(args, ensure_ascii=False)) for i, (name, args) in enumerate(calls)])
    got_content, got_calls = split_whole(get_tool_parser(parser), reply, SCHEMAS, new_ids())
    assert (got_content, [(c.id, c.name, c.arguments) for c in got_calls]) == want
    for k in DELTA_TOKENS:
        _, deltas = token_deltas(tokenizer, reply, k)
        streamed = stream(parser, deltas)
        check_shape(streamed)
        assert assemble(streamed) == want, k
    by_char = stream(parser, list(reply))
    assert assemble(by_char) == want


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_long_arguments_stream_in_pieces(tokenizer, parser):
    """A long call is seen building up: its arguments arrive in many pieces, before the reply ends."""
    reply, _, _ = next(case for case in CASES[parser] if any(n == "write_file" for n, _ in case[2]))
    _, deltas = token_deltas(tokenizer, reply, 1)
    pieces = [d for d in stream(parser, deltas) if "tool_calls" in d and "id" not in d["tool_calls"][0]]
    assert len(pieces) > 10


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_earlier_calls_rendered_into_a_prompt_read_back_the_same(parser):
    """A template without tool support gets the assistant's earlier calls written in the format (render_calls):
    the format's own reader must read them back as the same calls."""
    calls = [PARIS, WRITE, COUNT]
    text = get_tool_parser(parser).render_calls([{"name": n, "arguments": a} for n, a in calls])
    content, got = split_whole(get_tool_parser(parser), text, SCHEMAS, new_ids())
    assert content is None and [(c.name, json.loads(c.arguments)) for c in got] == calls
