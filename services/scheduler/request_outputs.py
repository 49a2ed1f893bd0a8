"""Per-request rules: stop conditions on token ids, the RequestOutput a step produces, admission validation."""

from __future__ import annotations

from services.common.step_contract import TokenLogprob
from services.scheduler.request import Request, RequestOutput, RequestRejectedError, RequestStatus


def stop_status(request: Request, token: int, eos_token_ids: frozenset[int],
                max_model_len: int) -> RequestStatus | None:
    """The FINISHED_* status that `token` (just appended) puts the request in, or None to go on."""
    params = request.sampling
    num_output = len(request.output_token_ids)
    if num_output >= params.min_tokens:
        if (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            request.stop_token_id = token
            return RequestStatus.FINISHED_STOPPED
    if num_output >= params.max_tokens or len(request.prompt_token_ids) + num_output >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


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


def validate_request(request: Request, kv, max_model_len: int) -> None:
    """Refuse (RequestRejectedError) a request that could never run: too long, or more KV than the whole pool."""
    n, limit = request.num_prompt_tokens, max_model_len
    if n == 0 or n >= limit:
        raise RequestRejectedError(
            f"prompt has {n} tokens; this model's context length is {limit} tokens, so a prompt must have "
            f"1 to {limit - 1} tokens to leave room for output: shorten the prompt", "context_length_exceeded")
    # The most KV it will ever hold: every token but the last sampled one.
    final_len = min(n + request.sampling.max_tokens, limit)
    if not kv.can_fit(final_len - 1):
        raise RequestRejectedError(
            f"prompt ({n}) + max_tokens ({request.sampling.max_tokens}) needs KV for {final_len - 1} tokens, "
            f"but the whole KV cache holds {kv.num_usable_blocks * kv.block_size}: "
            "lower max_tokens or give the worker more KV memory", "kv_cache_too_small")
