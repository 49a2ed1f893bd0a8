"""Beam search inside the scheduler (beam_groups.py) against transformers' generate(num_beams=W) on a tiny random
Llama, through a worker whose paged "KV" is what the logits are computed from (beam_worker.py): 4 prompts x beams
2 and 4, synchronous and async scheduling, small blocks (most forks copy a partial block), the invariants
(block ref counts included) checked after every step; and the group's life: abort mid-beam, preemption, worker
loss."""

from __future__ import annotations

import pytest
import torch

from steploop.common.beam_ranking import BeamConfig
from steploop.common.sampling_params import SamplingParams
from steploop.scheduler import beam_groups
from steploop.scheduler.beam_groups import BeamRequest
from steploop.scheduler.request import Request, RequestStatus
from tests.beam_model import EOS, PROMPTS, tiny_beam_llama
from tests.scheduler.beam_worker import PagedFakeWorker
from tests.scheduler.sched_factories import create_scheduler

MAX_NEW = 7
BLOCK = 4


@pytest.fixture(scope="module")
def model():
    return tiny_beam_llama()


def hf_beams(model, prompt, width, penalty, early, max_new=MAX_NEW):
    out = model.generate(torch.tensor([prompt]), do_sample=False, num_beams=width, num_return_sequences=width,
                         length_penalty=penalty, early_stopping=early, max_new_tokens=max_new, eos_token_id=EOS,
                         pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    beams = []
    for row, indices, score in zip(out.sequences, out.beam_indices, out.sequences_scores):
        length = int((indices >= 0).sum())
        beams.append((row[len(prompt):len(prompt) + length].tolist(), score.item()))
    return beams


def beam_request(rid, prompt, width, penalty=1.0, early=False, max_tokens=MAX_NEW, logprobs=-1, arrival=0.0):
    return Request(request_id=rid, prompt_token_ids=list(prompt), arrival_time=arrival,
                   sampling=SamplingParams(max_tokens=max_tokens, logprobs=logprobs),
                   beam=BeamConfig(width, penalty, early))


def run(sched, worker, max_steps=500, after_step=None):
    """Synchronous or with one plan in flight (async), invariants after every step; outputs by request id."""
    outs, pending, steps = {}, None, 0
    while sched.has_unfinished_requests() or pending is not None:
        plan = sched.schedule() if sched.has_unfinished_requests() else None
        sched.check_integrity()
        if sched.config.async_scheduling:
            if pending is not None:
                _collect(outs, sched.update_from_output(*pending))
            pending = (plan, worker.execute(plan)) if plan is not None else None
        else:
            _collect(outs, sched.update_from_output(plan, worker.execute(plan)))
        sched.check_integrity()
        steps += 1
        if after_step is not None:
            after_step(steps)
        assert steps < max_steps, "no progress"
    return outs


def _collect(outs, outputs):
    for out in outputs:
        assert out.request_id not in outs, f"{out.request_id}: output after its final one"
        if out.request_id.startswith("g"):         # a group streams nothing but its end
            assert out.finish_reason is not None and not out.new_token_ids
        if out.finish_reason is not None:
            outs[out.request_id] = out


def assert_idle(sched):
    assert not sched.requests and not sched.beam_groups
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks, "blocks leaked"


def check_equal(got, want):
    assert [h.tokens for h in got] == [w[0] for w in want]
    for h, (tokens, score) in zip(got, want):
        assert h.score == pytest.approx(score, abs=1e-4)
        assert h.cum_logprob == pytest.approx(sum(lp.logprob for lp in h.logprobs), abs=1e-4)
        assert h.finish_reason == ("stop" if tokens[-1] == EOS else "length")


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("width,penalty,early", [(2, 1.0, False), (4, 1.0, False), (4, 0.0, True),
                                                 (2, 2.0, "never")])
def test_equals_transformers(model, width, penalty, early, async_scheduling):
    """All 4 prompts at once (their groups share steps), exact against transformers."""
    sched = create_scheduler(block_size=BLOCK, num_blocks=200, eos_token_ids=(EOS,),
                             async_scheduling=async_scheduling)
    worker = PagedFakeWorker(model, 200, BLOCK)
    for i, prompt in enumerate(PROMPTS):
        sched.add_request(beam_request(f"g{i}", prompt, width, penalty, early, arrival=float(i)))
    outs = run(sched, worker)
    for i, prompt in enumerate(PROMPTS):
        out = outs[f"g{i}"]
        assert out.finish_reason == RequestStatus.FINISHED_STOPPED
        check_equal(out.beams, hf_beams(model, prompt, width, penalty, early))
    assert worker.num_copies > 0, "no fork copied a partial block: the test misses copy on write"
    assert_idle(sched)


def test_prefix_caching_off_and_block_of_one(model):
    """Without prefix caching beams still share their blocks (inside the group); block_size 1 never copies."""
    for block, caching in ((4, False), (1, True)):
        sched = create_scheduler(block_size=block, num_blocks=400, eos_token_ids=(EOS,),
                                 enable_prefix_caching=caching)
        worker = PagedFakeWorker(model, 400, block)
        sched.add_request(beam_request("g", PROMPTS[2], 4))
        check_equal(run(sched, worker)["g"].beams, hf_beams(model, PROMPTS[2], 4, 1.0, False))
        assert_idle(sched)


@pytest.mark.parametrize("abort_at", [1, 2, 3, 5])
def test_abort_mid_beam_leaks_nothing(model, abort_at):
    sched = create_scheduler(block_size=BLOCK, num_blocks=200, eos_token_ids=(EOS,))
    worker = PagedFakeWorker(model, 200, BLOCK)
    sched.add_request(beam_request("g", PROMPTS[0], 4, max_tokens=20))
    sched.add_request(Request(request_id="plain", prompt_token_ids=[1, 2, 3], arrival_time=1.0,
                              sampling=SamplingParams(max_tokens=12, ignore_eos=True)))
    seen = {}

    def abort(step):
        if step == abort_at:
            seen["beams"] = sum(isinstance(r, BeamRequest) for r in sched.requests.values())
            (out,) = sched.abort_requests(["g"])
            assert out.finish_reason == RequestStatus.FINISHED_ABORTED and out.beams is None
            sched.check_integrity()

    outs = run(sched, worker, after_step=abort)
    assert seen["beams"] >= 1 and "g" not in outs and outs["plain"].finish_reason is not None
    assert_idle(sched)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_takes_the_whole_group(model, monkeypatch, async_scheduling):
    """A pool that holds one group but not three: groups are preempted whole (no beam of one left running) and
    recomputed, and stay exact."""
    sched = create_scheduler(block_size=BLOCK, num_blocks=22, eos_token_ids=(EOS,), max_num_batched_tokens=16,
                             async_scheduling=async_scheduling)
    worker = PagedFakeWorker(model, 22, BLOCK)
    prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[1]]
    for i, prompt in enumerate(prompts):
        sched.add_request(beam_request(f"g{i}", prompt, 4, max_tokens=12, arrival=float(i)))
    whole = []
    preempt_group = beam_groups.preempt_group

    def checked(sched, group, plan):
        preempt_group(sched, group, plan)
        whole.append(all(b.status is not RequestStatus.RUNNING for b in group.beams))
    monkeypatch.setattr(beam_groups, "preempt_group", checked)
    outs = run(sched, worker, max_steps=2000)
    assert sched.num_preemptions > 0 and whole and all(whole)
    for i, prompt in enumerate(prompts):
        check_equal(outs[f"g{i}"].beams, hf_beams(model, prompt, 4, 1.0, False, max_new=12))
    assert_idle(sched)


def test_worker_loss_mid_beam_recomputes(model):
    sched = create_scheduler(block_size=BLOCK, num_blocks=200, eos_token_ids=(EOS,))
    worker = PagedFakeWorker(model, 200, BLOCK)
    sched.add_request(beam_request("g", PROMPTS[1], 4))
    state = {"worker": worker}

    def lose(step):
        if step == 3:
            sched.preempt_all()
            state["worker"].__init__(model, 200, BLOCK)    # a new worker: empty KV, nothing held
            sched.check_integrity()
    outs = run(sched, worker, after_step=lose)
    check_equal(outs["g"].beams, hf_beams(model, PROMPTS[1], 4, 1.0, False))
    assert_idle(sched)


def test_user_logprobs_and_usage(model):
    sched = create_scheduler(block_size=BLOCK, num_blocks=200, eos_token_ids=(EOS,))
    worker = PagedFakeWorker(model, 200, BLOCK)
    sched.add_request(beam_request("g", PROMPTS[0], 2, logprobs=9))
    out = run(sched, worker)["g"]
    assert all(len(lp.top_token_ids) == 9 for h in out.beams for lp in h.logprobs)   # max(K=4, 9)
    assert out.num_prompt_tokens == len(PROMPTS[0]) and out.num_output_tokens == max(len(h.tokens) for h in out.beams)


def test_refused():
    sched = create_scheduler(block_size=BLOCK, eos_token_ids=(EOS,), num_blocks=20, max_num_seqs=8)
    with pytest.raises(ValueError, match="1 to 16 beams"):
        sched.add_request(beam_request("g", [1, 2], 17))
    with pytest.raises(ValueError, match="max-num-seqs"):
        sched.add_request(beam_request("g", [1, 2], 9))
    with pytest.raises(ValueError, match="KV blocks"):        # 4 beams x 6 blocks each do not fit 19 blocks
        sched.add_request(beam_request("g", [1, 2], 4, max_tokens=20))
    req = beam_request("h", [1, 2], 2)
    req.sampling = SamplingParams(max_tokens=4, prompt_logprobs=1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        sched.add_request(req)
    assert not sched.requests and not sched.beam_groups
