"""Without a model: the scheduler's encoder slices (encoder_budget.py). A layer of an image of L tokens costs
L / depth of the step's encoder budget; an image larger than the budget is accepted and progresses at least one
layer per step; its chunk waits before it until what is left fits a step; prefill pacing's allowance caps slices."""

from __future__ import annotations

from types import SimpleNamespace

from steploop.scheduler.prefill_pacing import PrefillPacer
from tests.scheduler.sched_factories import create_scheduler
from tests.vlm.test_image_keys_and_budget import feature, request

BS = 4


def sliced(budget: int, depth: int = 4):
    sched = create_scheduler(max_num_batched_tokens=64, block_size=BS, max_num_encoder_input_tokens=budget,
                             enable_prefix_caching=False, max_decode_slowdown=0)
    sched.encoder.depth = depth
    return sched


def test_the_chunk_before_an_image_slices_it_and_the_next_step_finishes_it():
    sched = sliced(budget=4)
    r = request("r", [feature("img", 4, 8)])         # 8 tokens, 4 layers: a layer costs 2 of the budget of 4
    sched.add_request(r)
    first = sched.schedule()
    assert first.num_scheduled_tokens == [4] and first.encoder_slices == [("img", 2)]
    assert sched.encoder.layers_left == {"img": 2}
    second = sched.schedule()                        # the 2 layers left (4 tokens) fit: the chunk goes through
    assert second.num_scheduled_tokens == [20] and second.encoder_slices == []
    assert not sched.encoder.layers_left and sched.encoder.num_encoded == 1
    assert sched.schedule().encoder_free_hashes == ["img"]
    sched.check_integrity()


def test_an_image_whose_layer_exceeds_the_budget_runs_a_layer_per_step_alone():
    sched = sliced(budget=1)                         # a layer costs 2: more than the whole budget
    sched.add_request(request("r", [feature("img", 4, 8)]))
    plans = [sched.schedule() for _ in range(5)]
    assert [p.encoder_slices for p in plans[:4]] == [[("img", 1)]] * 4
    assert [p.num_scheduled_tokens for p in plans] == [[4], [], [], [], [20]]
    sched.check_integrity()


def test_a_waiting_request_at_an_image_runs_it_whole_when_nothing_else_encodes():
    sched = sliced(budget=2)
    sched.add_request(request("r", [feature("img", 0, 8)]))    # no token before it: nothing to slice ahead of
    plan = sched.schedule()
    assert plan.num_scheduled_tokens == [24] and plan.encoder_slices == [] and sched.encoder.num_encoded == 1


def test_slices_fit_the_pacers_allowance():
    cost = SimpleNamespace(coefficients=lambda: (0.010, 0.001, 0.0), encoder_token_seconds=lambda: 0.002)
    pacer = PrefillPacer(2.0, BS, cost)
    pacer.tally_decodes(4, 100)
    pacer.begin_step(4)                              # allowance: (2 - 1) * (0.010 + 4 * 0.001) s
    assert pacer.encoder_tokens_affordable() == 7
    pacer.spend_encoder(5)
    assert pacer.encoder_tokens_affordable() == 2
