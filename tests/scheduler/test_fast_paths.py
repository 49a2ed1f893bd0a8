"""The decode path's two forms: the scheduler's C loops for plain decodes (services/scheduler/fastpath) against
its one Python path. Over random workloads (tests/scheduler/workload_hash.py: sync/async, drafts, prefix cache,
priority, pacing, LoRA seats, small pools, aborts, failed steps, lost workers, and every tenth with 8x the
requests for long runs of plain decodes), a scheduler with the C loops and one without must build byte-identical
plans and equal outputs, step for step. And the stop rule has one encoding (stop_rule.py), which both read."""

from __future__ import annotations

import itertools

import pytest

from steploop.common.sampling_params import SamplingParams
from steploop.scheduler import fastpath
from steploop.scheduler.request import Request, RequestStatus
from steploop.scheduler.stop_rule import stop_status
from tests.scheduler.sched_factories import EOS, FakeWorker, create_scheduler, run_until_idle
from tests.scheduler.workload_hash import run_workload


@pytest.mark.parametrize("seeds", [range(40), range(40, 80)])
def test_c_loops_build_the_plans_and_outputs_of_the_python_path(seeds):
    for seed in seeds:
        assert run_workload(seed, c_loops=True) == run_workload(seed, c_loops=False), f"workload {seed}"


def params_stop(request: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """The stop rule read straight from the sampling params (as it was written before its encoding)."""
    p, n = request.sampling, len(request.output_token_ids)
    if n >= p.min_tokens and ((token == EOS and not p.ignore_eos) or token in p.stop_token_ids):
        return RequestStatus.FINISHED_STOPPED
    if n >= p.max_tokens or len(request.prompt_token_ids) + n >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


@pytest.mark.parametrize("ignore_eos, stop_ids, min_tokens, max_tokens, prompt_len",
                         list(itertools.product([False, True], [(), (11, 12)], [0, 3], [4, None], [1, 20])))
def test_the_stop_rule_encoding_says_what_the_sampling_params_say(ignore_eos, stop_ids, min_tokens, max_tokens,
                                                                 prompt_len):
    max_model_len = 32                               # max_tokens None: the context decides the length
    sched = create_scheduler(max_model_len=max_model_len)
    sampling = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                              stop_token_ids=stop_ids)
    request = Request("r", list(range(100, 100 + prompt_len)), sampling=sampling)
    sched.add_request(request)
    for n in range(1, max_model_len - prompt_len + 1):
        request.output_token_ids = [50] * n
        for token in (EOS, 11, 12, 50):
            request.stop_token_id = None
            assert stop_status(request, token) == params_stop(request, token, max_model_len), (n, token)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("c_loops", [False, True], ids=["python", "c"])
def test_min_tokens_holds_a_stop_id_back_on_both_paths(async_scheduling, c_loops):
    """A stop id sampled before min_tokens does not stop the request, whichever path takes its decodes; the first
    one after does."""
    def model(tokens: list[int]) -> int:
        return 11 if len(tokens) % 2 else 50
    sched = create_scheduler(async_scheduling=async_scheduling)
    sched.c_loops = fastpath.load() if c_loops else None
    prompt = list(range(100, 107))                 # odd: every other output is the stop id 11
    sched.add_request(Request("r", prompt, sampling=SamplingParams(max_tokens=20, min_tokens=6,
                                                                   stop_token_ids=(11,))))
    run = run_until_idle(sched, FakeWorker(model=model))
    assert run.finish["r"] == RequestStatus.FINISHED_STOPPED
    tokens = run.tokens["r"]
    assert tokens == [11, 50, 11, 50, 11, 50, 11]


def test_c_loops_build_where_gcc_is():
    """Where gcc and Python's headers are (CI, the worker image), the scheduler gets its C loops; a disabled or
    unbuildable extension leaves it on the Python path."""
    import shutil
    import sysconfig
    from pathlib import Path

    if shutil.which("gcc") and (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        assert fastpath.load() is not None
        assert create_scheduler().c_loops is not None
