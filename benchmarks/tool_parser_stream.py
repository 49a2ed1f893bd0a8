"""What reading tool calls as they stream costs the gateway:  python -m benchmarks.tool_parser_stream [--chars N]

Every delta rescans the reply (the format's `scan`; stream.py), which keeps streamed and whole replies identical
but grows with the reply. This times, per --tool-call-parser, one reply holding a call whose arguments are a long
string (--chars characters, about a quarter as many tokens), fed 4 characters per delta (about a token), beside
the same reply read whole; rounds alternate parsers so machine drift spreads over all. Reports microseconds per
delta (median of rounds) and writes benchmarks/results/tool_parser_stream.json with the machine it ran on.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import statistics
import time

from benchmarks.machine import git_commit, machine_info
from steploop.gateway.tool_parsers import TOOL_PARSERS, CallSplitter, get_tool_parser, split_whole
from tests.gateway import tool_format_cases as cases

RESULTS = pathlib.Path(__file__).parent / "results" / "tool_parser_stream.json"
WRITERS = {"hermes": cases.hermes, "qwen3_coder": cases.qwen3_coder, "glm45": cases.glm45,
           "deepseek_v3": cases.deepseek_v3, "kimi_k2": cases.kimi_k2, "granite": cases.granite,
           "pythonic": cases.pythonic, "openai": cases.harmony,
           "mistral": lambda *c: "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in c]),
           "llama3_json": lambda *c: "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in c)}


def reply(parser: str, chars: int) -> str:
    content = (cases.CODE * (chars // len(cases.CODE) + 1))[:chars]
    return WRITERS[parser](("write_file", {"path": "/tmp/a.py", "content": content}))


def streamed_s(parser: str, text: str) -> tuple[float, int]:
    splitter = CallSplitter(get_tool_parser(parser), cases.SCHEMAS, itertools.count().__next__)
    deltas = [text[i:i + 4] for i in range(0, len(text), 4)]
    start = time.perf_counter()
    for delta in deltas:
        splitter.feed(delta)
    splitter.finish()
    return time.perf_counter() - start, len(deltas)


def whole_s(parser: str, text: str) -> float:
    start = time.perf_counter()
    split_whole(get_tool_parser(parser), text, cases.SCHEMAS, itertools.count().__next__)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chars", type=int, default=8000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    texts = {p: reply(p, args.chars) for p in TOOL_PARSERS}
    per_delta: dict[str, list[float]] = {p: [] for p in TOOL_PARSERS}
    whole: dict[str, list[float]] = {p: [] for p in TOOL_PARSERS}
    for _ in range(args.rounds):
        for parser in TOOL_PARSERS:
            seconds, deltas = streamed_s(parser, texts[parser])
            per_delta[parser].append(seconds / deltas * 1e6)
            whole[parser].append(whole_s(parser, texts[parser]) * 1e3)
    table = {p: {"us_per_delta": round(statistics.median(per_delta[p]), 1),
                 "whole_ms": round(statistics.median(whole[p]), 2), "reply_chars": len(texts[p])}
             for p in TOOL_PARSERS}
    for parser, row in table.items():
        print(f"{parser:12s} {row['us_per_delta']:8.1f} us/delta streamed   {row['whole_ms']:7.2f} ms whole   "
              f"({row['reply_chars']} chars)")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"commit": git_commit(), "machine": machine_info(), "chars": args.chars,
                                   "rounds": args.rounds, "parsers": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
