"""Gemma 3 with images through the real scheduler and a real worker (in process): greedy tokens equal transformers'
generate (its bidirectional same-image mask from token_type_ids) for the whole prompt in one step and for chunked
prefill whose chunks keep each image whole; a repeated image hits the prefix cache; two different images never
share a block."""

from __future__ import annotations

import pytest

from steploop.common.sampling_params import SamplingParams
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.model_runner import ModelRunner
from steploop.scheduler.request import Request
from tests.scheduler.sched_factories import create_scheduler
from tests.vlm.engine_steps import assert_images_never_share_a_block, run
from tests.vlm.gemma3_models import TOKENS_PER_IMAGE, oracle_generate, png_bytes, prompt_with_images

MAX_TOKENS = 6
BLOCK = 4


@pytest.fixture(scope="module")
def runner(gemma3_folder):
    return ModelRunner.from_config(WorkerConfig(model=str(gemma3_folder), num_kv_blocks=128, max_model_len=256,
                                                device="cpu", block_size=BLOCK), gemma3_folder)


@pytest.fixture(scope="module")
def pngs():
    return [png_bytes(40, 30, 1), png_bytes(40, 30, 2), png_bytes(24, 36, 3)]


def scheduler(runner, budget, **config):
    sched = create_scheduler(max_num_batched_tokens=budget, max_num_seqs=2, block_size=BLOCK, num_blocks=128,
                             max_num_encoder_input_tokens=2 * TOKENS_PER_IMAGE, **config)
    sched.encoder.whole_images = runner.info.images_whole       # what the engine loop copies from the hello
    return sched


def request(rid, ids, features):
    return Request(rid, list(ids), sampling=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                   mm_features=list(features))


def test_the_worker_says_its_images_are_whole(runner):
    assert runner.info.accepts_images and runner.info.images_whole


@pytest.mark.parametrize("budget", [256, 21])
def test_greedy_equals_transformers_whole_and_chunked(runner, gemma3_oracle, gemma3_folder, pngs, budget):
    """256: the prompt in one step. 21: chunks of at most 21 tokens; each stops before an image it cannot finish,
    so both 16-token images are prefilled whole."""
    ids, features = prompt_with_images([pngs[0], pngs[2]], [5, 7, 6], gemma3_folder, seed=1)
    assert len(ids) > budget or budget == 256
    want = oracle_generate(gemma3_oracle, ids, features, MAX_TOKENS)
    sched = scheduler(runner, budget, enable_prefix_caching=False)
    r = request("a", ids, features)
    sched.add_request(r)
    starts = []
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        if plan.scheduled_handles and r.num_computed_tokens <= len(ids):
            n = plan.num_scheduled_tokens[0]
            starts.append((r.num_computed_tokens - n, n))
        result = runner.execute(plan)
        assert not result.error, result.error
        sched.update_from_output(plan, result)
    runner.execute(sched.schedule())
    assert r.output_token_ids == want
    for start, n in starts:                 # no chunk ends inside an image
        assert not any(f.offset < start + n < f.end for f in features)
    assert (len(starts) > 1) == (budget < len(ids))


def test_repeated_image_hits_the_prefix_cache_and_outputs_agree(runner, gemma3_oracle, gemma3_folder, pngs):
    ids, features = prompt_with_images([pngs[0]], [5, 9], gemma3_folder, seed=2)
    want = oracle_generate(gemma3_oracle, ids, features, MAX_TOKENS)
    sched = scheduler(runner, 64)
    first, second = request("first", ids, features), request("second", ids, features)
    assert run(sched, runner, [first])["first"] == want
    assert run(sched, runner, [second])["second"] == want
    assert second.num_cached_tokens >= features[0].end - BLOCK      # every full block of the image hit


def test_a_hit_that_ends_inside_an_image_finishes_the_image_in_one_chunk(runner, gemma3_oracle, gemma3_folder, pngs):
    """The same prompt again, ending just after the image, its image ending mid-block: the hit stops at the last
    full block, inside the image, so the second request's first chunk starts mid-image and finishes it, reading
    the image's earlier keys from the cache (computed with the whole image visible, as transformers does)."""
    ids, features = prompt_with_images([pngs[1]], [4, 0], gemma3_folder, seed=3)
    ids = ids[:features[0].end + 1]                       # the prompt ends one token after the image
    want = oracle_generate(gemma3_oracle, ids, features, MAX_TOKENS)
    sched = scheduler(runner, 64)
    assert run(sched, runner, [request("first", ids, features)])["first"] == want
    second = request("second", ids, features)
    assert run(sched, runner, [second])["second"] == want
    assert features[0].offset < second.num_cached_tokens < features[0].end


def test_different_images_never_share_a_block(runner, gemma3_oracle, gemma3_folder, pngs):
    ids_a, feats_a = prompt_with_images([pngs[0]], [9, 11], gemma3_folder, seed=2)
    ids_b, feats_b = prompt_with_images([pngs[1]], [9, 11], gemma3_folder, seed=2)
    assert ids_a == ids_b and feats_a[0].hash != feats_b[0].hash       # the same tokens, other pixels
    sched = scheduler(runner, 64)
    a, b = request("a", ids_a, feats_a), request("b", ids_b, feats_b)
    assert_images_never_share_a_block(sched, runner, a, b, BLOCK,
                                      {"a": oracle_generate(gemma3_oracle, ids_a, feats_a, MAX_TOKENS),
                                       "b": oracle_generate(gemma3_oracle, ids_b, feats_b, MAX_TOKENS)})


def test_preempted_image_request_recomputes_the_same_tokens(runner, gemma3_oracle, gemma3_folder, pngs):
    ids, features = prompt_with_images([pngs[0], pngs[2]], [5, 7, 6], gemma3_folder, seed=1)
    want = oracle_generate(gemma3_oracle, ids, features, MAX_TOKENS)
    sched = scheduler(runner, 21, enable_prefix_caching=False)
    r = request("a", ids, features)
    sched.add_request(r)
    for _ in range(3):                      # past the first image, before the second is done
        plan = sched.schedule()
        sched.update_from_output(plan, runner.execute(plan))
    assert features[0].end <= r.num_computed_tokens < features[1].end
    runner.execute(sched.preempt_running())
    assert r.num_preemptions == 1
    assert run(sched, runner, [])["a"] == want


def test_gemma3_images_are_refused_on_cuda(gemma3_folder, monkeypatch):
    """The Triton / CUDA path has no same-image mask: the worker refuses at start rather than serve other tokens."""
    monkeypatch.setattr(WorkerConfig, "resolved_device", lambda self: "cuda")
    with pytest.raises(ValueError, match="CPU only"):
        ModelRunner.from_config(WorkerConfig(model=str(gemma3_folder), max_model_len=256, block_size=BLOCK),
                                gemma3_folder)
