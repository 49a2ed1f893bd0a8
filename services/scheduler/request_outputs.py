"""Per-request rules: the RequestOutput a step produces, admission validation (max_tokens resolved and checked
against the context here, and only here; embedding requests checked against the worker's runner and pooling
config). The stop rule on token ids is in stop_rule.py."""

from __future__ import annotations

import dataclasses

from steploop.common.pooling_params import PoolingConfig, unsupported_api_message
from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import TokenLogprob
from steploop.scheduler.request import Request, RequestOutput, RequestRejectedError, RequestStatus


def make_output(request: Request, tokens: list[int], logprobs: list[TokenLogprob] | None) -> RequestOutput:
    status = request.status
    # Positional: this runs once per sampling request per step.
    return RequestOutput(request.request_id, tokens, logprobs, status if status > RequestStatus.PREEMPTED else None,
                         request.stop_token_id, len(request.prompt_token_ids), len(request.output_token_ids),
                         request.num_cached_tokens, request.error)


def add_prompt_logprobs(request: Request, logprobs: list[TokenLogprob], start: int) -> None:
    """Keep the logprobs of prompt tokens start+1, start+2, ... that the request does not have yet (a chunk
    recomputed after preemption repeats ones it has), up to the last prompt token."""
    have = request.prompt_logprobs
    skip = len(have) - start
    if skip >= 0:
        have.extend(logprobs[skip:request.num_prompt_tokens - 1 - start])


def resolve_max_tokens(num_prompt_tokens: int, sampling: SamplingParams, max_model_len: int) -> int:
    """max_tokens as the engine runs it: the one asked for, or what fits in the context when unset (None). The
    one check of prompt + max_tokens against the context; raises RequestRejectedError naming both numbers."""
    n, asked = num_prompt_tokens, sampling.max_tokens
    if asked is not None and asked < 1:
        raise RequestRejectedError(f"max_tokens must be at least 1, got {asked} (leave it unset for as many as "
                                   "fit in the context)", "invalid_value", "max_tokens")
    least = 1 if asked is None else asked
    if n + least > max_model_len:
        completion = "at least 1 (max_tokens unset)" if asked is None else str(asked)
        raise RequestRejectedError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{n + least} tokens ({n} in the prompt, {completion} in the completion). Please reduce the length "
            f"of the prompt{'' if asked is None else ' or max_tokens'}.", "context_length_exceeded",
            "prompt" if n >= max_model_len else "max_tokens")   # the part that does not fit
    max_tokens = max_model_len - n if asked is None else asked
    if sampling.min_tokens > max_tokens:   # EOS could never end it, and max_tokens would cut it short
        raise RequestRejectedError(
            f"min_tokens ({sampling.min_tokens}) must be <= max_tokens ({max_tokens}"
            f"{', what fits in the context' if asked is None else ''})", "invalid_value", "min_tokens")
    return max_tokens


def validate_request(request: Request, kv, max_model_len: int) -> None:
    """Refuse (RequestRejectedError) a request that could never run: no prompt, over the context, or more KV than
    the whole pool. Resolves request.sampling.max_tokens (unset: what fits)."""
    n = request.num_prompt_tokens
    if n == 0:
        raise RequestRejectedError("the prompt must contain at least one token", "invalid_value")
    max_tokens = resolve_max_tokens(n, request.sampling, max_model_len)
    if max_tokens != request.sampling.max_tokens:
        request.sampling = dataclasses.replace(request.sampling, max_tokens=max_tokens)
    check_resumed_outputs(request, max_tokens)
    # The most KV it will ever hold: every token but the last sampled one.
    final_len = n + max_tokens
    if not kv.can_fit(final_len - 1):
        raise RequestRejectedError(
            f"prompt ({n}) + max_tokens ({max_tokens}) needs KV for {final_len - 1} tokens, "
            f"but the whole KV cache holds {kv.num_usable_blocks * kv.block_size}: "
            "lower max_tokens or give the worker more KV memory", "kv_cache_too_small")


def check_runner(request: Request, pooling: PoolingConfig | None) -> None:
    """An embedding request needs a pooling worker and a generation request a generate one (vLLM's words)."""
    if request.pooling is not None and pooling is None:
        raise RequestRejectedError(unsupported_api_message("Embeddings"), "model_not_supported", "model")
    if request.pooling is None and pooling is not None:
        raise RequestRejectedError("The model does not support generation: it is served with --runner pooling "
                                   "(embedding requests only)", "model_not_supported", "model")


def validate_pooling_request(request: Request, kv, max_model_len: int, pooling: PoolingConfig) -> None:
    """An embedding request's prompt (no completion) must fit the context and the KV pool; `dimensions` must be
    one the model allows."""
    n = request.num_prompt_tokens
    if n == 0:
        raise RequestRejectedError("the input must contain at least one token", "invalid_value", "input")
    if n > max_model_len:
        raise RequestRejectedError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested {n} tokens in "
            "the input for embedding generation. Please reduce the length of the input.",
            "context_length_exceeded", "input")
    if not kv.can_fit(n):
        raise RequestRejectedError(f"the input ({n} tokens) needs more KV than the whole cache holds "
                                   f"({kv.num_usable_blocks * kv.block_size}): give the worker more KV memory",
                                   "kv_cache_too_small", "input")
    try:
        pooling.check_dimensions(request.pooling.dimensions, "this model")
    except ValueError as exc:
        raise RequestRejectedError(str(exc), "invalid_value", "dimensions") from exc


def check_resumed_outputs(request: Request, max_tokens: int) -> None:
    """A migrated request's delivered outputs (GenerateRequest.resume_output_token_ids) must leave a token to
    generate, and its prompt logprobs went out with the first delivery."""
    num_resumed = len(request.output_token_ids)
    if not num_resumed:
        return
    if num_resumed >= max_tokens:
        raise RequestRejectedError(f"{num_resumed} resumed output tokens leave nothing to generate under max_tokens "
                                   f"({max_tokens})", "invalid_value", "resume_output_token_ids")
    if request.sampling.prompt_logprobs >= 0:
        raise RequestRejectedError("a resumed request cannot ask for prompt logprobs (they came with its first "
                                   "delivery)", "invalid_value", "prompt_logprobs")
