"""Encoder slices: an image's vision tower run a few layers per step (scheduler/encoder_budget.py plans them,
gpu_worker/encoder_cache.py keeps the hidden state, model/vision_slices.py splits the towers). The split embeddings
are bit-identical to the oracle's whole tower (Qwen2.5-VL's windowed blocks and Gemma 3's SigLIP); through a real
scheduler and worker, greedy tokens equal transformers' while no step runs more than its encoder budget, decodes
go on meanwhile, and preemption / abort mid-encode leaves no partial state behind."""

from __future__ import annotations

import pytest
import torch

from steploop.common.sampling_params import SamplingParams
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.model.vision_slices import encode_in_slices
from steploop.gpu_worker.model_runner import ModelRunner
from steploop.scheduler.request import Request
from tests.scheduler.sched_factories import create_scheduler
from tests.vlm.engine_steps import run
from tests.vlm.vlm_models import oracle_generate, prompt_with_images

BLOCK = 4
MAX_TOKENS = 4


def make_runner(folder):
    return ModelRunner.from_config(WorkerConfig(model=str(folder), num_kv_blocks=128, max_model_len=256,
                                                device="cpu", block_size=BLOCK), folder)


@pytest.fixture(scope="module")
def runner(vlm_folder):
    return make_runner(vlm_folder)


@pytest.fixture(scope="module")
def gemma(gemma3_folder):
    return make_runner(gemma3_folder)


def gemma3_prompt(folder, seed):
    from tests.vlm.gemma3_models import png_bytes, prompt_with_images as gemma3_prompt_with_images
    return gemma3_prompt_with_images([png_bytes(40, 30, seed)], [5, 7], folder, seed=seed)


def sliced_scheduler(runner, budget: int, **kw):
    sched = create_scheduler(block_size=BLOCK, num_blocks=128, max_num_encoder_input_tokens=budget, **kw)
    sched.encoder.depth = runner.info.encoder_layers
    return sched


def request(rid, ids, features, max_tokens=MAX_TOKENS):
    return Request(rid, list(ids), sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   mm_features=list(features))


def test_split_tower_is_bit_identical_to_the_whole_one(runner, two_image_prompt, gemma, gemma3_folder):
    _, gemma_features = gemma3_prompt(gemma3_folder, seed=3)
    for model, feature in ((runner.model, two_image_prompt[1][0]), (gemma.model, gemma_features[0])):
        assert model.encoder_layers == 2
        whole = model.encode_image(feature)                  # the oracle's own tower module, whole
        for layers in (1, 2):
            assert torch.equal(encode_in_slices(model, feature, layers), whole)


def test_sliced_images_give_the_oracles_tokens_and_stay_within_the_budget(runner, vlm_oracle, two_image_prompt):
    ids, features = two_image_prompt                        # images of 12 and 10 tokens, 2 tower layers
    want = oracle_generate(vlm_oracle, ids, features, MAX_TOKENS)
    text, _ = prompt_with_images([], [20], seed=9)
    sched = sliced_scheduler(runner, 6, max_num_batched_tokens=64, enable_prefix_caching=False)
    streaming = request("text", text, [], max_tokens=12)
    sched.add_request(streaming)
    plans, out, encoded = [], {"a": [], "text": []}, runner.encoder.num_encoded
    sched.add_request(request("a", ids, features))
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        plans.append(plan)
        result = runner.execute(plan)
        for o in sched.update_from_output(plan, result):
            out[o.request_id] += o.new_token_ids
        sched.check_integrity()
        assert sched.encoder.left >= 0 or len(plan.encoder_slices) == 1        # one layer of 12: 6 tokens
    runner.execute(sched.schedule())
    assert out["a"] == want and len(out["text"]) == 12
    # each image: its first layer (6 or 5 tokens) in a slice, the last one and the merger when its chunk reaches it
    assert [(h, n) for p in plans for h, n in p.encoder_slices] == [(f.hash, 1) for f in features]
    assert runner.encoder.num_encoded - encoded == 2
    assert not runner.encoder.entries and not runner.encoder.partial and not sched.encoder.sizes
    # the text stream decoded in every step until it finished, the encoder slices beside it
    decoding = [p for p in plans if streaming.handle in p.scheduled_handles]
    assert len(decoding) >= 12 and any(p.encoder_slices for p in decoding)


def test_a_repeated_image_is_not_encoded_again(runner, vlm_oracle, images):
    ids, features = prompt_with_images([images[0]], [9, 11], seed=2)
    want = oracle_generate(vlm_oracle, ids, features, MAX_TOKENS)
    sched = sliced_scheduler(runner, 6, max_num_batched_tokens=64)
    first, second = request("first", ids, features), request("second", ids, features)
    second.arrival_time = first.arrival_time
    out = run(sched, runner, [first, second])               # the second reuses the first's partial state
    assert out == {"first": want, "second": want}
    assert sched.encoder.num_encoded == 1 and sched.encoder.num_hits == 1


@pytest.mark.parametrize("end", ["preempt", "abort"])
def test_preempted_or_aborted_mid_encode_frees_the_partial_state(runner, vlm_oracle, two_image_prompt, end):
    ids, features = two_image_prompt
    sched = sliced_scheduler(runner, 3, max_num_batched_tokens=64, enable_prefix_caching=False)
    r = request("a", ids, features)
    sched.add_request(r)
    plan = sched.schedule()
    runner.execute(plan)
    assert plan.encoder_slices == [(features[0].hash, 1)] and features[0].hash in runner.encoder.partial
    if end == "abort":
        sched.abort_requests(["a"])
        runner.execute(sched.schedule())
        assert not sched.requests
    else:
        runner.execute(sched.preempt_running())
        assert r.num_preemptions == 1
        run(sched, runner, [])
        assert r.output_token_ids == oracle_generate(vlm_oracle, ids, features, MAX_TOKENS)
    runner.execute(sched.schedule())
    assert not runner.encoder.partial and not runner.encoder.entries
    assert not sched.encoder.sizes and not sched.encoder.layers_left


def test_gemma3_sliced_images_give_the_oracles_tokens(gemma, gemma3_folder, gemma3_oracle):
    from tests.vlm.gemma3_models import oracle_generate as gemma3_generate
    ids, features = gemma3_prompt(gemma3_folder, seed=4)
    want = gemma3_generate(gemma3_oracle, ids, features, MAX_TOKENS)
    sched = sliced_scheduler(gemma, 8, max_num_batched_tokens=64, enable_prefix_caching=False)
    sched.encoder.whole_images = True
    out = run(sched, gemma, [request("g", ids, features)])
    assert out["g"] == want and sched.encoder.num_slices >= 1
