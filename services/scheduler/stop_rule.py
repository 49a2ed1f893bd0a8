"""The stop rule on token ids, in one encoding that the Python path and the C loops (fastpath/decode_loop.c) read.

add_request writes each request's rule into three Request fields, and nothing reads its sampling params for it:

    stop_ids           ids that stop it: its stop_token_ids, and EOS unless ignore_eos
    min_output_tokens  no stop id counts before this many output tokens (sampling.min_tokens)
    max_output_tokens  it stops at this many output tokens: max_tokens or what fits in max_model_len, whichever first

A token just appended as output number n (resumed outputs count) stops the request as FINISHED_STOPPED when it is
in stop_ids and n >= min_output_tokens, else as FINISHED_LENGTH when n >= max_output_tokens. The C loop applies
the same test to a plain decode's token and hands a request that stops back to Python (stop_status below), which
finishes it. An embedding request samples nothing: its rule is empty (max_output_tokens 0).
"""

from __future__ import annotations

from collections.abc import Iterable

from steploop.scheduler.request import Request, RequestStatus


class StopRules:
    """Writes requests' stop rules for one scheduler (its EOS ids and context length)."""

    def __init__(self, eos_token_ids: Iterable[int], max_model_len: int) -> None:
        self.max_model_len = max_model_len
        # stop_ids without stop_token_ids, by ignore_eos: shared, so the per-token check hits a hot set.
        self._no_stop_ids = {False: frozenset(eos_token_ids), True: frozenset()}

    def encode(self, request: Request) -> None:
        """Write the request's rule; a generation request's max_tokens is resolved first (validate_request)."""
        if request.pooling is not None:          # an embedding request samples nothing
            request.stop_ids, request.min_output_tokens, request.max_output_tokens = frozenset(), 0, 0
            return
        params = request.sampling
        request.stop_ids = (frozenset(params.stop_token_ids) | self._no_stop_ids[params.ignore_eos]
                            if params.stop_token_ids else self._no_stop_ids[params.ignore_eos])
        request.min_output_tokens = params.min_tokens
        request.max_output_tokens = min(params.max_tokens, self.max_model_len - len(request.prompt_token_ids))


def stop_status(request: Request, token: int) -> RequestStatus | None:
    """The FINISHED_* status that `token` (just appended to the outputs) puts the request in, or None to go on."""
    num_output = len(request.output_token_ids)
    if token in request.stop_ids and num_output >= request.min_output_tokens:
        request.stop_token_id = token
        return RequestStatus.FINISHED_STOPPED
    if num_output >= request.max_output_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None
