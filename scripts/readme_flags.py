"""Writes the README's complete flag tables from the commands' own argument parsers, so they cannot drift.

    python scripts/readme_flags.py           rewrite the section between the markers in README.md
    python scripts/readme_flags.py --check   exit 1 (saying so) if README.md is not what this would write

The section sits between `<!-- flags:begin -->` and `<!-- flags:end -->`. Defaults are the parsers' own, read
with every STEPLOOP_* variable unset (they would move them). tests/serve/test_readme_flags.py runs --check.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BEGIN, END = "<!-- flags:begin -->", "<!-- flags:end -->"
SERVICES = ("serve", "gateway", "scheduler", "worker")   # one table: serve takes the other three's flags
_ENV_SUFFIX = re.compile(r"\s*\(env STEPLOOP_\w+; default [^()]*(\([^()]*\)[^()]*)*\)$")


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, built as the command builds it, with no STEPLOOP_* variable in effect."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from steploop import serve
    from steploop.bench import serve as bench_serve
    from steploop.gateway import server as gateway
    from steploop.gpu_worker import gguf_convert
    from steploop.gpu_worker import server as worker
    from steploop.scheduler import server as scheduler
    saved = {name: value for name, value in os.environ.items() if name.startswith("STEPLOOP_")}
    for name in saved:
        del os.environ[name]
    try:
        return {"serve": serve.build_parser(), "gateway": gateway.build_parser(),
                "scheduler": scheduler.build_parser(), "worker": worker.build_parser(),
                "convert": gguf_convert.build_parser(), "bench serve": bench_serve.build_parser()}
    finally:
        os.environ.update(saved)


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The flags a user can give: optional arguments, not --help, not hidden (serve's refused --scheduler-address)."""
    return [a for a in parser._actions if a.option_strings and a.dest != "help" and a.help != argparse.SUPPRESS]


def meaning(action: argparse.Action) -> str:
    text = _ENV_SUFFIX.sub("", action.help or "").strip()
    # a table cell: no pipes, and no raw tags outside `code` (GitHub would swallow <tool_call>)
    parts = text.replace("|", "\\|").replace("\n", " ").split("`")
    parts[::2] = [part.replace("<", "&lt;").replace(">", "&gt;") for part in parts[::2]]
    return "`".join(parts) or "–"


def default(action: argparse.Action) -> str:
    value = action.default
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if value else "off"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off"                        # a switch: off unless given
    if value is None:
        return "unset"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, (list, dict)):
        value = json.dumps(value)
    return f"`{value}`" if str(value) != "" else '`""`'


def flag_cell(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)


def services_table(all_parsers: dict[str, argparse.ArgumentParser]) -> list[str]:
    """One row per destination: which of serve / gateway / scheduler / worker take it, each command's default."""
    rows: dict[str, dict[str, argparse.Action]] = {}
    for command in SERVICES:
        for action in options(all_parsers[command]):
            rows.setdefault(action.dest, {})[command] = action
    out = ["| flag | taken by | default | meaning |", "| --- | --- | --- | --- |"]
    for by_command in rows.values():
        names: list[str] = []
        for command, action in by_command.items():
            for name in action.option_strings:
                if name not in names:
                    names.append(name)
        cell = ", ".join(f"`{n}`" + ("" if all(n in a.option_strings for a in by_command.values()) else
                                     f" ({', '.join(c for c, a in by_command.items() if n in a.option_strings)})")
                         for n in names)
        taken = "all" if len(by_command) == len(SERVICES) else ", ".join(by_command)
        defaults: dict[str, list[str]] = {}
        for command, action in by_command.items():
            defaults.setdefault(default(action), []).append(command)
        shown = next(iter(defaults)) if len(defaults) == 1 else \
            "; ".join(f"{value} ({', '.join(commands)})" for value, commands in defaults.items())
        action = next(iter(by_command.values()))
        out.append(f"| {cell} | {taken} | {shown} | {meaning(action)} |")
    return out


def command_table(parser: argparse.ArgumentParser) -> list[str]:
    out = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for action in options(parser):
        out.append(f"| {flag_cell(action.option_strings)} | {default(action)} | {meaning(action)} |")
    return out


HEADER = ("<!-- generated by scripts/readme_flags.py from the commands' parsers; edit the parsers' help, then run "
          "it -->")
SUMMARY = "<details><summary>Every flag of every command (generated from the parsers)</summary>"
SERVICES_INTRO = ("`steploop serve`, `gateway`, `scheduler` and `worker` (serve takes every flag of the other three, "
                  "except `--scheduler-address`):")


def render() -> str:
    all_parsers = parsers()
    lines = [BEGIN, HEADER, "", SUMMARY, "", SERVICES_INTRO, "", *services_table(all_parsers)]
    for command in ("convert", "bench serve"):
        lines += ["", f"`steploop {command}`:", "", *command_table(all_parsers[command])]
    return "\n".join([*lines, "", "</details>", END])


def rewrite(text: str, section: str) -> str:
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + section + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that README.md is up to date")
    args = parser.parse_args(argv)
    text = README.read_text()
    if BEGIN not in text or END not in text:
        sys.exit(f"README.md has no {BEGIN} ... {END} section")
    new = rewrite(text, render())
    if args.check:
        if new != text:
            print("README.md's flag tables are out of date: run python scripts/readme_flags.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
