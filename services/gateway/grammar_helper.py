"""The gateway's grammar compiler, in a child process: `python -m steploop.gateway.grammar_helper`.

The gateway never imports torch, and `import xgrammar` does (its package imports its torch kernels, and tvm_ffi,
its binding layer, imports torch when installed). So the admission check (grammar_check.py) runs here: one JSON
line in (`{"kind": "regex" | "json_schema" | "grammar" | "structural_tag", "text": ...}`), one JSON line out (`{"error": str | null,
"warnings": [str]}`). Compiling to xgrammar's Grammar needs no tokenizer and gives the same errors the worker's
compiler gives. xgrammar reports what it ignores ("Lookahead assertion is not supported and is ignored") only as
log lines on fd 2, so fd 2 goes to a file that is read back after each compile.

xgrammar's grammar modules are loaded without its package `__init__` (which imports the torch-using matcher), with
torch blocked; if that ever fails (a new xgrammar layout), the whole package is imported instead.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import sys
import tempfile
import types
from typing import Any

_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Warning: )?")


def load_grammar_class() -> Any:
    """xgrammar.Grammar, loaded without torch when possible."""
    spec = importlib.util.find_spec("xgrammar")
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError("xgrammar is not installed")
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None          # tvm_ffi imports torch only if it can
    try:
        package = types.ModuleType("xgrammar")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules["xgrammar"] = package
        importlib.import_module("xgrammar.load_binding")   # the native library, before the modules that bind it
        importlib.import_module("xgrammar.exception")
        return importlib.import_module("xgrammar.grammar").Grammar
    except Exception:  # noqa: BLE001 - another layout: fall back to the whole package (torch included)
        for name in [m for m in sys.modules if m == "xgrammar" or m.startswith("xgrammar.")]:
            del sys.modules[name]
        if blocked:
            del sys.modules["torch"]
        return importlib.import_module("xgrammar").Grammar


def clean(line: str) -> str:
    """xgrammar's message without its log prefix ("[21:30:15] /project/cpp/regex_converter.cc:94: ")."""
    return _LOG_PREFIX.sub("", line.strip())


def compile_one(grammar_cls: Any, kind: str, text: str, log: Any) -> dict[str, Any]:
    """Compile; what xgrammar raised (first line) and the warnings it logged while compiling."""
    log.seek(0)
    log.truncate()
    error = None
    try:
        if kind == "regex":
            grammar_cls.from_regex(text)
        elif kind == "grammar":
            grammar_cls.from_ebnf(text)
        elif kind == "structural_tag":
            grammar_cls.from_structural_tag(text)
        else:
            grammar_cls.from_json_schema(text, any_whitespace=False)   # as the worker compiles it
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError / its own errors
        lines = [line for line in str(exc).splitlines() if line.strip()]
        error = clean(lines[0]) if lines else type(exc).__name__
    log.seek(0)
    warnings = [clean(line) for line in log.read().decode(errors="replace").splitlines() if "Warning" in line]
    return {"error": error, "warnings": list(dict.fromkeys(warnings))}


def main() -> None:
    grammar_cls = load_grammar_class()
    out = sys.stdout
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 2)             # xgrammar's C++ log goes to fd 2
        out.write(json.dumps({"ready": True}) + "\n")
        out.flush()
        for line in sys.stdin:
            try:
                ask = json.loads(line)
                answer = compile_one(grammar_cls, ask["kind"], ask["text"], log)
            except Exception as exc:  # noqa: BLE001 - a malformed ask: say so, keep serving
                answer = {"error": f"helper: {exc}", "warnings": []}
            out.write(json.dumps(answer) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
