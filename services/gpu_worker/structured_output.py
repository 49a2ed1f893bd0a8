"""Structured output: a grammar (JSON schema, any JSON object, a regex, an EBNF grammar or a structural tag) masks
the tokens a request may sample.

One xgrammar GrammarCompiler per worker, built on first use from the model folder's tokenizer (so a worker that
never sees a structured request never loads it); compiled grammars are cached by xgrammar. Each structured
request gets a GrammarMatcher:

    - created the first time the request samples, and advanced with its output tokens so far, so a request
      resumed after preemption (it comes back with its outputs) rebuilds its matcher from them;
    - before sampling, it fills the request's row of a packed bitmask (1 bit per token, set = allowed); a row
      verifying draft tokens j > 0 fills its mask after accepting drafts[:j], then rolls them back;
    - after sampling, the worker advances it with the tokens it accepted (async scheduling needs nothing more:
      the worker appends its own tokens).
Matchers of requests that left the batch are dropped at the next step.

A grammar xgrammar cannot compile, or would compile only by dropping part of it (a lookahead in a `pattern`:
grammar_lint.py), is never served unconstrained or empty: the request gets no matcher, samples nothing, and the
step result reports it as failed (StepResult.failed) so the scheduler ends it alone with that error. Each new
request's grammar is compiled when the plan brings it (`check_new`), so a failure ends it before its prompt runs.
"""

from __future__ import annotations

import functools
import logging
import pathlib
import re
from typing import Any

import torch

from steploop.common.grammar_lint import regex_problem, schema_problem
from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import NewRequestData, RequestFailure
from steploop.common.structural_tag import structural_tag_problem

log = logging.getLogger(__name__)

MAX_ROLLBACK = 16   # drafts a matcher may try and undo in one step
ANY_OBJECT = '{"type": "object"}'
GRAMMAR_ERROR = "invalid_grammar"   # the RequestFailure code of a grammar that cannot be served as asked


class GrammarRefused(Exception):
    """The request's grammar cannot be served as asked; `failure` says why, for the client."""

    def __init__(self, failure: RequestFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class StructuredOutput:
    def __init__(self, model_dir: pathlib.Path | None, vocab_size: int) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._matchers: dict[int, tuple[Any, Any]] = {}   # handle -> (RequestState it belongs to, matcher)
        self._failed: dict[int, tuple[Any, RequestFailure]] = {}   # handle -> (RequestState, why), until it leaves
        self._unreported: list[int] = []                  # failed handles no step result has named yet

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            if self.model_dir is None:
                raise RuntimeError("structured output needs the model folder's tokenizer; none was given")
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler

    def compile(self, params: SamplingParams) -> Any:
        """The request's grammar (xgrammar caches compilations). Raises GrammarRefused for a regex, EBNF grammar,
        structural tag or JSON schema that does not compile or would be enforced only in part. json_object is an
        object, as OpenAI's JSON mode promises (xgrammar's builtin JSON grammar also takes arrays and scalars)."""
        compiler = self._get_compiler()
        if params.regex:
            param, what, text, lint = "regex", "regex", params.regex, regex_problem
            build = compiler.compile_regex
        elif params.grammar:
            param, what, text, lint = "grammar", "grammar", params.grammar, None
            build = compiler.compile_grammar
        elif params.structural_tag:
            param, what, text, lint = "structural_tag", "structural tag", params.structural_tag, structural_tag_problem
            build = compiler.compile_structural_tag
        elif params.json_schema:
            param, what, text, lint = "json_schema", "JSON schema", params.json_schema, schema_problem
            build = functools.partial(compiler.compile_json_schema, any_whitespace=False)
        else:
            return compiler.compile_json_schema(ANY_OBJECT, any_whitespace=False)
        problem = lint(text) if lint is not None else None
        if problem is not None:
            raise GrammarRefused(RequestFailure(GRAMMAR_ERROR, f"the {what} cannot be enforced: {problem} is not "
                                                               "supported by the grammar engine (xgrammar)", param))
        try:
            return build(text)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError on what it cannot compile
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise GrammarRefused(RequestFailure(GRAMMAR_ERROR, f"the {what} does not compile: {_clean(reason)}",
                                                param)) from None

    def check_new(self, new_requests: list[NewRequestData], states: dict[int, Any]) -> None:
        """Compile the grammar of each structured request a plan brings, so one that cannot be served fails
        before its prompt runs (the matcher built later finds the compilation cached)."""
        for new in new_requests:
            state = states.get(new.handle)
            if state is not None and state.sampling.structured:
                try:
                    self.compile(state.sampling)
                except GrammarRefused as refused:
                    self._fail(state, refused.failure)

    def _fail(self, state, failure: RequestFailure) -> None:
        log.warning("handle %d cannot be served as asked: %s", state.handle, failure.message)
        self._failed[state.handle] = (state, failure)
        self._unreported.append(state.handle)

    def failed(self, state) -> bool:
        held = self._failed.get(state.handle)
        return held is not None and held[0] is state

    def take_failures(self) -> dict[int, RequestFailure]:
        """The requests that failed since the last call (handle -> why), for the step result."""
        out = {h: self._failed[h][1] for h in self._unreported if h in self._failed}
        self._unreported.clear()
        return out

    def matcher(self, state) -> Any:
        """The request's matcher, (re)built from its output tokens when new or when the handle changed owner;
        None when its grammar cannot be served (the request is failed)."""
        import xgrammar as xgr

        held = self._matchers.get(state.handle)
        if held is not None and held[0] is state:
            return held[1]
        if self.failed(state):
            return None
        try:
            grammar = self.compile(state.sampling)
        except GrammarRefused as refused:
            self._fail(state, refused.failure)
            return None
        matcher = xgr.GrammarMatcher(grammar, max_rollback_tokens=MAX_ROLLBACK)
        for token in state.output_token_ids:
            if not matcher.accept_token(token):
                log.warning("handle %d: output token %d does not fit its grammar", state.handle, token)
                break
        self._matchers[state.handle] = (state, matcher)
        return matcher

    def bitmask(self, rows: list[tuple[Any, list[int]]]) -> tuple[torch.Tensor, list[int]] | None:
        """rows [S]: (RequestState, drafts before this row's token). Returns (bitmask [S, W], grammar rows)."""
        structured = [r for r, (state, _) in enumerate(rows) if state.sampling.structured]
        if not structured:
            return None
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for r in structured:
            state, drafts = rows[r]
            matcher = self.matcher(state)
            if matcher is None:               # failed: its row is sampled but never reported
                continue
            accepted = 0
            for token in drafts:
                if not matcher.accept_token(token):
                    break
                accepted += 1
            if not matcher.is_terminated():   # terminated: it sampled its stop token; this row gets discarded
                matcher.fill_next_token_bitmask(mask, r)
            if accepted:
                matcher.rollback(accepted)
        return mask, structured

    def accept(self, state, tokens: list[int]) -> None:
        held = self._matchers.get(state.handle)
        if held is None or held[0] is not state:
            return
        for token in tokens:
            if held[1].is_terminated() or not held[1].accept_token(token):
                break

    def drop_missing(self, live: dict[int, Any]) -> None:
        """Forget matchers of requests no longer in the batch."""
        for held in (self._matchers, self._failed):
            for handle in [h for h, (state, _) in held.items() if live.get(h) is not state]:
                del held[handle]


def _clean(reason: str) -> str:
    """xgrammar's message without its log prefix ("[21:30:15] /project/cpp/regex_converter.cc:94: ")."""
    return re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", reason)
