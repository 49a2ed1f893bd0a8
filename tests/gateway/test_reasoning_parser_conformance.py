"""Every --reasoning-parser fed the same replies, cut where the default model's tokenizer cuts them (1, 2, 3 and 7
tokens per delta, and whole): the reasoning and the content must come out the same every way, nothing dropped."""

from __future__ import annotations

import itertools

import pytest

from steploop.gateway.text.reasoning import REASONING_PARSERS, get_reasoning_parser
from steploop.gateway.tool_parsers import CallSplitter, get_tool_parser
from tests.gateway.test_tool_parser_conformance import DELTA_TOKENS, token_deltas
from tests.gateway.tool_format_cases import PARIS, SCHEMAS, harmony, js

THINK = "The user greets me. 2 < 3, and <b> is not a tag here.\n你好 🎉"
ANSWER = "Hello! The end."


def think_cases(open_: str, close: str, starts_in_reasoning: bool) -> list[tuple[str, str, str]]:
    return [
        (f"{open_}{THINK}{close}\n\n{ANSWER}", THINK, ANSWER),
        (f"{open_}{THINK}", THINK, ""),                                  # cut while thinking
        (ANSWER, *((ANSWER, "") if starts_in_reasoning else ("", ANSWER))),
        (open_[:3], *((open_[:3], "") if starts_in_reasoning else ("", open_[:3]))),
    ]


CASES = {
    "deepseek_r1": [*think_cases("<think>", "</think>", True), (f"{THINK}</think>{ANSWER}", THINK, ANSWER)],
    "qwen3": think_cases("<think>", "</think>", False),
    "deepseek_v3": think_cases("<think>", "</think>", False),
    "glm45": think_cases("<think>", "</think>", False),
    "kimi_k2": think_cases("<think>", "</think>", False),
    "granite": [*think_cases("Here is my thought process:", "Here is my response:", False),
                (f"Here's my thought process:{THINK}Here's my response:{ANSWER}", THINK, ANSWER)],
    "mistral": think_cases("[THINK]", "[/THINK]", False),
    "openai_gptoss": [
        ((f"<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}"
         "<|return|>"), THINK, ANSWER),
        (f"<|channel|>analysis<|message|>{THINK}", THINK, ""),
        (f"<|channel|>final<|message|>{ANSWER}", "", ANSWER),
        (ANSWER, "", ANSWER),
        (f"<|channel|>analysis<|message|>{THINK}<|end|>" + harmony(PARIS), THINK, harmony(PARIS)),
    ],
}
ALL = [(name, *case) for name, cases in CASES.items() for case in cases]


def test_every_parser_has_cases():
    assert set(CASES) == set(REASONING_PARSERS)


def split(parser: str, deltas: list[str]) -> tuple[str, str]:
    splitter = get_reasoning_parser(parser).splitter()
    parts = [splitter.feed(d, last=i == len(deltas) - 1) for i, d in enumerate(deltas)]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


@pytest.mark.parametrize("parser, reply, reasoning, content", ALL)
def test_same_split_at_every_delta_size(tokenizer, parser, reply, reasoning, content):
    assert split(parser, [reply]) == (reasoning, content)
    for k in DELTA_TOKENS:
        text, deltas = token_deltas(tokenizer, reply, k)
        assert text == reply
        assert split(parser, deltas) == (reasoning, content), k
    assert split(parser, list(reply)) == (reasoning, content)


def test_gpt_oss_reasoning_then_harmony_calls(tokenizer):
    """openai_gptoss leaves a message to functions.* whole; the openai tool parser then reads it as a call."""
    reply = "<|channel|>analysis<|message|>Need weather.<|end|>" + harmony(PARIS)
    for k in DELTA_TOKENS:
        _, deltas = token_deltas(tokenizer, reply, k)
        splitter = get_reasoning_parser("openai_gptoss").splitter()
        calls = CallSplitter(get_tool_parser("openai"), SCHEMAS, itertools.count().__next__)
        reasoning = ""
        for i, delta in enumerate(deltas):
            r, c = splitter.feed(delta, last=i == len(deltas) - 1)
            reasoning += r
            calls.feed(c)
        calls.finish()
        assert reasoning == "Need weather."
        assert calls.result() == (None, [calls.calls[0]]) and (calls.calls[0].name, calls.calls[0].arguments) == (
            "get_weather", js(PARIS[1]))
