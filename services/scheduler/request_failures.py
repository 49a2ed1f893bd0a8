"""Requests that fail alone: the worker could not serve them as asked (StepResult.failed, e.g. a grammar xgrammar
cannot compile), so each ends with FINISHED_REJECTED and its error while the step's other requests go on.

A failed request sampled nothing this step. Ending it frees its blocks at once (Scheduler._finish) and tells the
worker in the next plan's finished handles; results for it from plans already in flight (async scheduling) are
dropped like those of any request that finished since its plan was built.
"""

from __future__ import annotations

from dataclasses import dataclass

from steploop.common.step_contract import RequestFailure
from steploop.scheduler.request import Request, RequestOutput, RequestStatus


@dataclass(slots=True)
class RejectedOutput(RequestOutput):
    """The last output of a FINISHED_REJECTED request: no tokens, `error` says why, and these say what to the
    client's error mapping. (A subclass: the plain RequestOutput is built field by field by the C decode loop.)"""

    error_code: str = ""                 # the OpenAI error code (e.g. "invalid_grammar")
    error_param: str = ""                # the SamplingParams field at fault ("json_schema", "regex")


def end_failed(scheduler, requests: list[Request], handles: list[int],
               failed: dict[int, RequestFailure]) -> list[RequestOutput]:
    """requests [m] and handles [m]: the plan's scheduled requests and their handles, in batch order. Ends every
    running one the worker failed; returns their last outputs (no tokens, the error)."""
    outputs = []
    for request, handle in zip(requests, handles):
        failure = failed.get(handle)
        if failure is None or request.status is not RequestStatus.RUNNING:
            continue   # not failed, or finished / aborted / preempted since the plan was built
        request.error = failure.message
        scheduler._finish(request, RequestStatus.FINISHED_REJECTED)
        outputs.append(RejectedOutput(request.request_id, [], None, RequestStatus.FINISHED_REJECTED, None,
                                      len(request.prompt_token_ids), len(request.output_token_ids),
                                      request.num_cached_tokens, failure.message, error_code=failure.code,
                                      error_param=failure.param))
    return outputs
