"""Qwen2.5-VL through the real scheduler and a real worker (in process): greedy tokens equal transformers'
generate with the same images, whatever the chunking (chunks that cut through an image's placeholder range), the
encoder budget, prefix-cache hits on a repeated image or preemption; every image is encoded once while needed; two
different images never share a cached block."""

from __future__ import annotations

import pytest

from steploop.common.sampling_params import SamplingParams
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.model_runner import ModelRunner
from steploop.scheduler.request import Request, RequestRejectedError
from tests.scheduler.sched_factories import create_scheduler
from tests.span_recorder import recorded_spans
from tests.vlm.engine_steps import assert_images_never_share_a_block, run
from tests.vlm.vlm_models import oracle_generate, prompt_with_images

MAX_TOKENS = 6
BLOCK = 4


@pytest.fixture(scope="module")
def runner(vlm_folder):
    return ModelRunner.from_config(WorkerConfig(model=str(vlm_folder), num_kv_blocks=128, max_model_len=256,
                                                device="cpu", block_size=BLOCK), vlm_folder)


def request(rid, ids, features):
    return Request(rid, list(ids), sampling=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                   mm_features=list(features))


@pytest.mark.parametrize("budget", [256, 7, 3])
def test_greedy_equals_transformers_whatever_the_chunks(runner, vlm_oracle, two_image_prompt, budget):
    ids, features = two_image_prompt
    want = oracle_generate(vlm_oracle, ids, features, MAX_TOKENS)
    sched = create_scheduler(max_num_batched_tokens=budget, max_num_seqs=2, block_size=BLOCK, num_blocks=128,
                             enable_prefix_caching=False, max_num_encoder_input_tokens=12, encoder_cache_size=24)
    encoded = runner.encoder.num_encoded
    assert run(sched, runner, [request("a", ids, features)])["a"] == want
    assert runner.encoder.num_encoded - encoded == 2        # once per image, though chunks cut both ranges
    assert not runner.encoder.entries and not sched.encoder.sizes   # freed once their ranges were computed


def test_encoder_budget_defers_the_second_image(runner, vlm_oracle, two_image_prompt):
    """A budget of one image per step: the chunk that reaches the second image stops before it that step."""
    ids, features = two_image_prompt
    want = oracle_generate(vlm_oracle, ids, features, MAX_TOKENS)
    sched = create_scheduler(max_num_batched_tokens=256, max_num_seqs=2, block_size=BLOCK, num_blocks=128,
                             max_num_encoder_input_tokens=12)
    r = request("a", ids, features)
    sched.add_request(r)
    first = sched.schedule()
    assert first.num_scheduled_tokens == [features[1].offset]      # up to the second image, not into it
    result = runner.execute(first)
    sched.update_from_output(first, result)
    out = run(sched, runner, [])
    assert result.sampled == {} and out["a"] == want
    assert sched.requests == {} and r.output_token_ids == want


def test_repeated_image_hits_the_prefix_cache_and_outputs_agree(runner, vlm_oracle, images):
    ids, features = prompt_with_images([images[0]], [9, 11], seed=2)
    want = oracle_generate(vlm_oracle, ids, features, MAX_TOKENS)
    sched = create_scheduler(max_num_batched_tokens=5, max_num_seqs=2, block_size=BLOCK, num_blocks=128,
                             max_num_encoder_input_tokens=12)
    first = request("first", ids, features)
    second = request("second", ids, features)
    assert run(sched, runner, [first])["first"] == want
    encoded = runner.encoder.num_encoded
    assert run(sched, runner, [second])["second"] == want
    assert second.num_cached_tokens >= features[0].end - BLOCK      # every full block of the image hit
    # the hit covers the image's range but for its last partial block, which is recomputed with the embeddings
    assert runner.encoder.num_encoded - encoded <= 1


def test_different_images_never_share_a_block(runner, vlm_oracle, images):
    ids_a, feats_a = prompt_with_images([images[0]], [9, 11], seed=2)
    ids_b, feats_b = prompt_with_images([images[1]], [9, 11], seed=2)
    assert ids_a == ids_b and feats_a[0].hash != feats_b[0].hash       # the same tokens, other pixels
    sched = create_scheduler(max_num_batched_tokens=64, max_num_seqs=2, block_size=BLOCK, num_blocks=128)
    a, b = request("a", ids_a, feats_a), request("b", ids_b, feats_b)
    assert_images_never_share_a_block(sched, runner, a, b, BLOCK,
                                      {"a": oracle_generate(vlm_oracle, ids_a, feats_a, MAX_TOKENS),
                                       "b": oracle_generate(vlm_oracle, ids_b, feats_b, MAX_TOKENS)})


def test_preempted_image_request_recomputes_the_same_tokens(runner, vlm_oracle, two_image_prompt):
    ids, features = two_image_prompt
    want = oracle_generate(vlm_oracle, ids, features, MAX_TOKENS)
    sched = create_scheduler(max_num_batched_tokens=8, max_num_seqs=2, block_size=BLOCK, num_blocks=128,
                             enable_prefix_caching=False, max_num_encoder_input_tokens=12)
    r = request("a", ids, features)
    sched.add_request(r)
    for _ in range(3):                      # into the first image's range
        plan = sched.schedule()
        sched.update_from_output(plan, runner.execute(plan))
    plan = sched.preempt_running()
    runner.execute(plan)
    assert r.num_preemptions == 1 and not sched.encoder.sizes
    assert run(sched, runner, [])["a"] == want


def test_an_image_larger_than_the_encoder_budget_is_refused(two_image_prompt):
    ids, features = two_image_prompt
    sched = create_scheduler(max_num_batched_tokens=64, block_size=BLOCK, max_num_encoder_input_tokens=8)
    with pytest.raises(RequestRejectedError, match="encoder budget"):
        sched.add_request(request("a", ids, features))


def test_encoding_is_traced_in_the_request_trace(runner, two_image_prompt):
    from steploop.common import tracing
    ids, features = two_image_prompt
    with recorded_spans() as memory:
        sched = create_scheduler(max_num_batched_tokens=256, block_size=BLOCK, num_blocks=128,
                                 enable_prefix_caching=False, max_num_encoder_input_tokens=24)
        parent = tracing.tracer().start_span("request")
        sched.add_request(request("traced", ids, features))
        while sched.has_unfinished_requests():
            plan = sched.schedule()
            for new in plan.new_requests:
                new.traceparent = tracing.traceparent_of(parent)
            sched.update_from_output(plan, runner.execute(plan))
        runner.execute(sched.schedule())
        parent.end()
    spans = [s for s in memory.get_finished_spans() if s.name == "steploop.worker.encode_image"]
    assert sorted(s.attributes["steploop.image_hash"] for s in spans) == sorted(f.hash for f in features)
    assert {s.attributes["steploop.image_tokens"] for s in spans} == {f.length for f in features}
    assert all(s.parent.span_id == parent.context.span_id for s in spans)
