"""Structured output: a grammar (JSON schema, any JSON object, or a regex) masks the tokens a request may sample.

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
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import torch

from services.common.sampling_params import SamplingParams

log = logging.getLogger(__name__)

MAX_ROLLBACK = 16   # drafts a matcher may try and undo in one step
ANY_OBJECT = '{"type": "object"}'


class StructuredOutput:
    def __init__(self, model_dir: pathlib.Path | None, vocab_size: int) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._matchers: dict[int, tuple[Any, Any]] = {}   # handle -> (RequestState it belongs to, matcher)

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
        """The grammar of a request. A schema xgrammar cannot compile falls back to "any JSON object" (logged):
        the worker has no per-request error channel, and failing the step would fail every request in it (the
        gateway refuses what it can tell is wrong: invalid schemas, refs that do not resolve).
        json_object is an object, as OpenAI's JSON mode promises (xgrammar's builtin JSON grammar also takes
        arrays and scalars)."""
        compiler = self._get_compiler()
        if params.regex:      # built by the gateway (guided_choice), which refuses what xgrammar cannot compile
            try:
                return compiler.compile_regex(params.regex)
            except Exception:  # noqa: BLE001 - a bug: end the output at once rather than let it run unconstrained
                log.error("cannot compile the regex %r; this request's output is empty", params.regex)
                return compiler.compile_regex("")
        if params.json_schema:
            try:
                return compiler.compile_json_schema(params.json_schema, any_whitespace=False)
            except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError on bad schemas
                log.warning("cannot compile JSON schema (%s); constraining to any JSON object instead", exc)
        return compiler.compile_json_schema(ANY_OBJECT, any_whitespace=False)

    def matcher(self, state) -> Any:
        """The request's matcher, (re)built from its output tokens when new or when the handle changed owner."""
        import xgrammar as xgr

        held = self._matchers.get(state.handle)
        if held is not None and held[0] is state:
            return held[1]
        matcher = xgr.GrammarMatcher(self.compile(state.sampling), max_rollback_tokens=MAX_ROLLBACK)
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
        for handle in [h for h, (state, _) in self._matchers.items() if live.get(h) is not state]:
            del self._matchers[handle]
