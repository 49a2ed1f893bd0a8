"""The code blocks of README.md, read from the README itself, and how each is run (or why it is not).

The convention, for whoever edits the README:
- A fenced block in `bash`, `sh`, `shell` or `python` is an example: the README test runs it against a live
  `steploop serve` and it must finish (exit 0) within 60 s on the default model.
- A block that must not run (installation, a server of its own, adapters or datasets the test has not) says why
  on the line just above its fence: `<!-- example: not run (REASON) -->`.
- Blocks under the `## Deployment` heading are not run: containers and clusters, which tests/deploy checks.
- Other languages (`text`, `json`, `yaml`, ...) are not examples. A fence with no language is an error, so a new
  example can neither go untested nor unmarked by accident.
"""

from __future__ import annotations

import pathlib
import re
from dataclasses import dataclass

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
RUN_LANGUAGES = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python"}
NOT_RUN = re.compile(r"^<!--\s*example:\s*not run\s*\((.+)\)\s*-->$")
NOT_RUN_SECTIONS = {"Deployment": "containers and clusters (tests/deploy checks those)"}
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


@dataclass(frozen=True)
class Block:
    line: int             # 1-based line of the opening fence
    section: str          # the `## ` heading it is under
    language: str
    code: str             # dedented to the fence's indentation
    not_run: str | None   # the reason given by its marker or section, None when it runs

    @property
    def runner(self) -> str | None:
        return RUN_LANGUAGES.get(self.language)

    @property
    def id(self) -> str:
        first = next((ln.strip() for ln in self.code.splitlines() if ln.strip() and not ln.strip().startswith("#")),
                     "")
        return f"L{self.line}-{self.language}-{re.sub(r'[^A-Za-z0-9]+', '-', first)[:40].strip('-')}"


def blocks(text: str | None = None) -> list[Block]:
    lines = (README.read_text() if text is None else text).splitlines()
    out, section, i = [], "", 0
    while i < len(lines):
        if lines[i].startswith("## "):
            section = lines[i][3:].strip()
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, language, start = fence.group(1), fence.group(2), i
        i += 1
        body = []
        while i < len(lines) and not re.match(rf"^{indent}```\s*$", lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        if i == len(lines):
            raise ValueError(f"README.md line {start + 1}: a code fence that is never closed")
        marker = NOT_RUN.match(lines[start - 1].strip()) if start else None
        reason = marker.group(1) if marker else NOT_RUN_SECTIONS.get(section)
        out.append(Block(start + 1, section, language, "\n".join(body) + "\n", reason))
        i += 1
    return out


def runnable() -> list[Block]:
    return [b for b in blocks() if b.runner and b.not_run is None]
