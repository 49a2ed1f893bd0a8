"""The real worker (`python -m steploop.gpu_worker`, same flags, same model) with a forward that raises on cue.

    python -m tests.integration.faulty_worker --scheduler-address ... (any gpu_worker flag)

STEPLOOP_TEST_FAULTS (JSON) says when: a list of {"marker": [token ids], "after_tokens": k}. A step raises
RuntimeError(FAULT_MESSAGE ...) when it schedules a request whose prompt contains a marker (contiguous token ids)
and which already has at least k output tokens on the worker: k = 0 fails its first prompt step, k > 0 fails the
step that computes its (k+1)-th token, after k tokens were streamed. Each request faults once, as a transient
fault would: under async scheduling the step already planned after the failed one still runs, normally, on the
worker's now stale view of the failed requests (the scheduler drops its results). Deterministic, no timing
involved.

What raises is ModelRunner._run, the forward part of a step, which ModelRunner.execute calls inside its own
try: the step is reported as StepResult(error=...), exactly as a real forward failure (CUDA error, OOM) would be,
and the worker process lives on. Nothing in the production code knows about this module.
"""

from __future__ import annotations

import json
import logging
import os
import sys

FAULT_MESSAGE = "injected forward failure"
log = logging.getLogger("steploop.worker.faulty")


def _contains(seq: list[int], marker: list[int]) -> bool:
    n = len(marker)
    return n > 0 and any(seq[i:i + n] == marker for i in range(len(seq) - n + 1))


def install(faults: list[dict]) -> None:
    # Imported here, not at the top: the test imports FAULT_MESSAGE from this module and needs no torch.
    from steploop.gpu_worker.model_runner import ModelRunner

    original = ModelRunner._run

    def _run(self: ModelRunner, plan, *args, **kwargs):
        for handle in plan.scheduled_handles:
            state = self.batch.requests.get(handle)
            if state is None or getattr(state, "fault_injected", False):
                continue
            prompt = state.token_ids[:state.num_prompt_tokens]
            for fault in faults:
                if state.num_output_tokens >= fault.get("after_tokens", 0) and _contains(prompt, fault["marker"]):
                    state.fault_injected = True     # this request's state lives as long as the request does
                    log.warning("step %d: injecting a forward failure (handle %d, %d output tokens)",
                                plan.step_id, handle, state.num_output_tokens)
                    raise RuntimeError(f"{FAULT_MESSAGE} at step {plan.step_id} (handle {handle}, "
                                       f"{state.num_output_tokens} output tokens)")
        return original(self, plan, *args, **kwargs)

    ModelRunner._run = _run


def main() -> int:
    from steploop.gpu_worker import server

    install(json.loads(os.environ.get("STEPLOOP_TEST_FAULTS", "[]")))
    return server.main()


if __name__ == "__main__":
    sys.exit(main())
