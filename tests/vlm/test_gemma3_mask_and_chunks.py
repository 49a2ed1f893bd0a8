"""Without a model: Gemma 3's same-image attention mask in the paged torch attention, checked against transformers'
own mask function, and the chunking rule that keeps each image whole in one chunk (scheduler and worker)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from steploop.common.mm_inputs import MultiModalFeature
from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import StepResult
from steploop.gpu_worker.attention.metadata import build_common_metadata
from steploop.gpu_worker.encoder_cache import _whole_span
from steploop.gpu_worker.model.windowed_attention import WindowedAttention
from steploop.scheduler.encoder_budget import paced_whole_image, whole_image_chunk
from steploop.scheduler.request import Request, RequestRejectedError
from tests.scheduler.sched_factories import create_scheduler

BS, H, HK, D = 4, 4, 2, 8


def feature(image_hash: str, offset: int, length: int) -> MultiModalFeature:
    return MultiModalFeature(image_hash, offset, length, (1, 4, 4), (3, 2, 2), b"\0" * 48)


def transformers_mask(seq_len: int, images: list[tuple[int, int]], window: int | None) -> torch.Tensor:
    """[seq_len, seq_len] bool as transformers builds it for Gemma 3: causal (and window) OR same image, its
    token_type_ids_mask_function given the processor's token_type_ids."""
    from transformers.models.gemma3.modeling_gemma3 import token_type_ids_mask_function
    token_type = torch.zeros(1, seq_len, dtype=torch.long)
    for lo, hi in images:
        token_type[0, lo:hi] = 1
    is_image = token_type == 1
    starts = is_image & ~torch.nn.functional.pad(is_image, (1, 0), value=0)[:, :-1]
    groups = torch.where(is_image, torch.cumsum(starts.int(), dim=1) - 1, -1)
    same_image = token_type_ids_mask_function(token_type, groups, 16)
    q, k = torch.arange(seq_len)[:, None], torch.arange(seq_len)[None, :]
    causal = (k <= q) & ((q - k < window) if window is not None else True)
    return causal | same_image(torch.tensor(0), torch.tensor(0), q, k)


@pytest.mark.parametrize("window", [None, 3])
def test_paged_attention_applies_the_same_image_mask(window):
    """Two requests in one step: r0 computes tokens 6..21 of a 22-token prompt whose image is [8, 18) (0..5 are in the
    cache); r1 decodes token 9 after an image at [2, 7) that is all in the cache. The output equals dense attention
    under transformers' mask over each request's whole sequence."""
    torch.manual_seed(0)
    seqs = [(22, 6, [(8, 18)]), (10, 9, [(2, 7)])]        # (context length, tokens cached before the step, images)
    q_full = [torch.randn(n, H, D) for n, _, _ in seqs]
    k_full = [torch.randn(n, HK, D) for n, _, _ in seqs]
    v_full = [torch.randn(n, HK, D) for n, _, _ in seqs]
    cache = torch.zeros(2, 16, BS, HK, D)
    tables = np.array([[1, 2, 3, 4, 5, 6], [7, 8, 9, 0, 0, 0]], dtype=np.int32)
    slots = []
    for r, (n, cached, _) in enumerate(seqs):            # the cached tokens' keys are already in their blocks
        for p in range(n):
            slot = tables[r, p // BS] * BS + p % BS
            if p < cached:
                cache[0].view(-1, HK, D)[slot], cache[1].view(-1, HK, D)[slot] = k_full[r][p], v_full[r][p]
            else:
                slots.append(slot)
    common = build_common_metadata(np.array([n - c for n, c, _ in seqs], dtype=np.int32),
                                   np.array([n for n, _, _ in seqs], dtype=np.int32), tables,
                                   np.array(slots, dtype=np.int64), BS, torch.device("cpu"))
    metadata = types.SimpleNamespace(common=common, image_spans={0: [(8, 18)]})   # r1's image is not computed now
    new = lambda t: torch.cat([t[r][c:] for r, (_, c, _) in enumerate(seqs)])
    scale = D ** -0.5
    out = WindowedAttention(H, HK, D, scale, window, None).forward(new(q_full), new(k_full), new(v_full), cache,
                                                                   metadata)
    want = []
    for r, (n, cached, images) in enumerate(seqs):
        mask = transformers_mask(n, images, window)[cached:]
        want.append(torch.nn.functional.scaled_dot_product_attention(
            q_full[r][cached:].transpose(0, 1), k_full[r].transpose(0, 1), v_full[r].transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True).transpose(0, 1))
    torch.testing.assert_close(out, torch.cat(want), rtol=1e-5, atol=1e-5)


def test_without_spans_the_mask_is_causal():
    """The same image positions, no image_spans (a step that computes no image token): plain causal attention
    differs from the image mask, so the spans are what changes it."""
    assert not torch.equal(transformers_mask(12, [(3, 9)], None), transformers_mask(12, [], None))


def test_a_chunk_stops_before_an_image_it_cannot_finish():
    images = [feature("a", 5, 16), feature("b", 30, 16)]
    assert whole_image_chunk(images, 0, 10) == 5            # would end inside a: stops before it
    assert whole_image_chunk(images, 0, 21) == 21           # ends at a's end
    assert whole_image_chunk(images, 0, 40) == 30           # a whole, b cut: stops before b
    assert whole_image_chunk(images, 12, 5) == 0            # starts inside a (a prefix hit) and cannot finish: waits
    assert whole_image_chunk(images, 12, 9) == 9            # finishes a from inside
    assert whole_image_chunk(images, 21, 9) == 9            # text only


def test_prefill_pacing_never_leaves_a_request_stuck_inside_an_image():
    """While streams decode the pacer may give a prompt chunk fewer tokens than an image: at the image's start (or
    inside it) the rest of the image runs; before it, the chunk keeps its paced length (clip stops it at the image)."""
    images = [feature("a", 5, 16)]
    assert paced_whole_image(images, 5, 40, 6) == 16           # at the image: all of it
    assert paced_whole_image(images, 12, 40, 3) == 9           # inside it (a prefix hit): its rest
    assert paced_whole_image(images, 5, 10, 6) == 6            # the unpaced budget cannot hold it either: clip waits
    assert paced_whole_image(images, 0, 40, 8) == 8            # before it: whole_image_chunk stops the chunk at 5
    assert paced_whole_image(images, 5, 40, 30) == 30          # not cut inside it
    assert paced_whole_image(images, 21, 40, 4) == 4           # after it


def request(rid: str, features, n: int = 60) -> Request:
    return Request(rid, list(range(100, 100 + n)), sampling=SamplingParams(max_tokens=2, ignore_eos=True),
                   mm_features=list(features))


def test_the_scheduler_keeps_images_whole_and_refuses_one_larger_than_a_step():
    sched = create_scheduler(max_num_batched_tokens=20, block_size=BS, num_blocks=64, enable_prefix_caching=False)
    sched.encoder.whole_images = True
    r = request("r", [feature("a", 5, 16), feature("b", 30, 16)])
    sched.add_request(r)
    chunks = []
    while r.num_computed_tokens < r.num_prompt:
        plan = sched.schedule()
        chunks.append((r.num_computed_tokens - plan.num_scheduled_tokens[0], plan.num_scheduled_tokens[0]))
        sched.update_from_output(plan, StepResult(step_id=plan.step_id))       # prompt chunks: nothing sampled
    assert chunks == [(0, 5), (5, 20), (25, 5), (30, 20), (50, 10)]
    small = create_scheduler(max_num_batched_tokens=12, max_num_seqs=2, block_size=BS, num_blocks=64,
                             max_num_encoder_input_tokens=32)   # the encoder could take it, a step cannot
    small.encoder.whole_images = True
    with pytest.raises(RequestRejectedError, match="one chunk"):
        small.add_request(request("big", [feature("a", 5, 16)]))
    threshold = create_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8, block_size=BS)
    threshold.encoder.whole_images = True
    with pytest.raises(RequestRejectedError, match="long-prefill-token-threshold"):
        threshold.add_request(request("big", [feature("a", 5, 16)]))


def test_the_worker_refuses_a_chunk_that_ends_inside_an_image():
    f = feature("a" * 64, 5, 16)
    assert _whole_span(f, 0, 21) == (5, 21) and _whole_span(f, 12, 9) == (5, 21)
    with pytest.raises(ValueError, match="ends inside"):
        _whole_span(f, 0, 10)
