"""Structured-output constraints checked at admission: a JSON schema or regex that xgrammar cannot compile, or would
compile only by dropping part of it, is a 400 naming the request field before anything is generated.

Two checks, cheapest first: grammar_lint.py finds the constructs xgrammar accepts but ignores (lookaheads, inline
flags) by name; then the constraint is compiled once by xgrammar in a child process (grammar_helper.py: importing
xgrammar imports torch, which the gateway never does), whose errors and "... is ignored" warnings refuse it too.
Results are cached (the same schema twice is one compile). Compiling runs in a thread, so the event loop never waits
on it. If the helper cannot start (no xgrammar beside the gateway), the request goes on: the worker compiles it
anyway and ends it with its error (FinishReason.REJECTED, mapped by `rejected`), never unconstrained. A constraint
the helper crashes or hangs on is refused: the worker would crash or stall on it too, with a whole step waiting.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import pathlib
import select
import subprocess
import sys
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import steploop
from steploop.common.engine_contract import EngineChunk
from steploop.common.grammar_lint import regex_problem, schema_problem
from steploop.common.structural_tag import structural_tag_problem
from steploop.gateway.errors import APIError

if TYPE_CHECKING:
    from steploop.gateway.openai_api.protocol import SamplingFields

logger = logging.getLogger("steploop.gateway")

CODE = "invalid_grammar"           # the OpenAI error code of a constraint that cannot be served as asked
CACHE_SIZE = 1024                  # distinct constraints remembered
TIMEOUT_S = 30.0                   # a compile that takes longer is refused (it would stall a worker step)


def constraint_field(sampling: SamplingFields) -> str:
    """The request field that holds the constraint, as a client wrote it ("" when nothing constrains the reply)."""
    source = sampling.constrained_by
    if not (sampling.json_schema or sampling.regex or sampling.json_object or sampling.grammar
            or sampling.structural_tag):
        return ""
    if source == "response_format":
        return "response_format.json_schema" if sampling.json_schema else "response_format"
    if source == "structured_outputs":
        return ("structured_outputs.json" if sampling.json_schema else
                "structured_outputs.choice" if sampling.regex else "structured_outputs.json_object")
    if source == "text.format":
        return "text.format.schema" if sampling.json_schema else "text.format"
    return source or "tools"       # nothing named it: the schema of a forced tool call


def rejected(chunk: EngineChunk, field: str) -> APIError:
    """The 400 for a request the worker could not serve as asked (FinishReason.REJECTED)."""
    where = field or chunk.error_param or "request"
    return APIError(400, f"'{where}': {chunk.error_message or 'the request cannot be served as asked'}",
                    param=where, code=chunk.error_code or CODE)


async def check_constraint(sampling: SamplingFields) -> None:
    """Raises a 400 APIError when the request's regex, grammar, structural tag or JSON schema cannot be enforced as
    written."""
    if sampling.regex:
        kind, text = "regex", sampling.regex
    elif sampling.grammar:
        kind, text = "grammar", sampling.grammar
    elif sampling.structural_tag:
        kind, text = "structural_tag", sampling.structural_tag
    elif sampling.json_schema:
        kind, text = "json_schema", sampling.json_schema
    else:
        return                     # json_object or nothing: always compiles
    problem = await CHECKER.problem(kind, text)
    if problem is not None:
        field = constraint_field(sampling)
        raise APIError(400, f"'{field}' {problem}", param=field, code=CODE)


# What xgrammar would compile by ignoring part of it, found by name first (an EBNF grammar: compiled only).
LINTS = {"regex": regex_problem, "json_schema": schema_problem, "structural_tag": structural_tag_problem}


class GrammarChecker:
    """One helper process, spawned on first use and shared by every request; answers are cached (LRU)."""

    def __init__(self, cache_size: int = CACHE_SIZE, timeout_s: float = TIMEOUT_S) -> None:
        self.cache_size, self.timeout_s = cache_size, timeout_s
        self.cache: OrderedDict[tuple[str, str], str | None] = OrderedDict()
        self.num_compiles = 0              # asks that reached the helper (tests: a cached one does not)
        self._cache_lock = threading.Lock()   # held briefly (the event loop takes it too)
        self._pipe_lock = threading.Lock()    # one ask at a time on the helper's pipes (held in a thread only)
        self._proc: subprocess.Popen | None = None
        self._broken = False               # the helper cannot start here: stop trying (logged once)
        atexit.register(self.close)

    async def problem(self, kind: str, text: str) -> str | None:
        """Why the constraint cannot be enforced ("does not compile: ...", "cannot be enforced: ..."), or None."""
        key = (kind, text)
        with self._cache_lock:             # a cache hit costs no thread hop and no parse
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
        lint = LINTS[kind](text) if kind in LINTS else None
        if lint is not None:
            return self._remember(key, f"cannot be enforced: {lint} is ignored by the grammar engine (xgrammar); "
                                       "rewrite the constraint without it")
        return await asyncio.to_thread(self._compile, key)

    def _compile(self, key: tuple[str, str]) -> str | None:
        with self._pipe_lock:
            with self._cache_lock:         # a concurrent ask for the same constraint compiled it meanwhile
                if key in self.cache:
                    return self.cache[key]
            answer = self._ask(*key)
        if answer is None:                 # no verdict (helper unavailable): not cached, the worker decides
            return None
        return self._remember(key, _verdict(answer))

    def _remember(self, key: tuple[str, str], problem: str | None) -> str | None:
        with self._cache_lock:
            self.cache[key] = problem
            if len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return problem

    def _ask(self, kind: str, text: str) -> dict | None:
        proc = self._helper()
        if proc is None:
            return None
        self.num_compiles += 1
        try:
            proc.stdin.write(json.dumps({"kind": kind, "text": text}) + "\n")
            proc.stdin.flush()
            return json.loads(self._read_line(proc))
        except (OSError, ValueError, TimeoutError) as exc:
            # It crashed or hung on this constraint: the worker would too, and stall every request of its step.
            logger.warning("grammar check: the xgrammar helper failed on a %s (%s); refusing it", kind, exc)
            self._stop()
            return {"refuse": f"the grammar compiler failed on it ({exc})"}

    def _helper(self) -> subprocess.Popen | None:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self._broken:
            return None
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "steploop.gateway.grammar_helper"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                          text=True, bufsize=1, env=_helper_env())
            ready = json.loads(self._read_line(self._proc))
            if not ready.get("ready"):
                raise ValueError(f"unexpected first line {ready!r}")
        except (OSError, ValueError, TimeoutError) as exc:
            logger.warning("grammar check: cannot start the xgrammar helper (%s); constraints are checked by the "
                           "worker only", exc)
            self._stop()
            self._broken = True
            return None
        return self._proc

    def _read_line(self, proc: subprocess.Popen) -> str:
        ready, _, _ = select.select([proc.stdout], [], [], self.timeout_s)
        if not ready:
            raise TimeoutError(f"no answer within {self.timeout_s:g} s")
        line = proc.stdout.readline()
        if not line:
            raise OSError(f"the helper exited (code {proc.poll()})")
        return line

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        with self._pipe_lock:
            self._stop()


def _helper_env() -> dict[str, str]:
    """This process's environment, with the folder this `steploop` package came from first on the path (the
    gateway may run from anywhere)."""
    root = str(pathlib.Path(steploop.__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


def _verdict(answer: dict) -> str | None:
    if answer.get("refuse"):
        return f"cannot be served: {answer['refuse']}"
    if answer.get("error"):
        return f"does not compile: {answer['error']}"
    if answer.get("warnings"):
        return (f"cannot be enforced: xgrammar would drop part of it ({'; '.join(answer['warnings'])}); rewrite it "
                "without that construct")
    return None


CHECKER = GrammarChecker()
