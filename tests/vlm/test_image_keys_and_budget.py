"""Without a model: image hashes in prefix-cache keys (both hash functions, and KV events' extra_keys as vLLM
publishes them), and the scheduler's encoder budget: chunks stop before an image the step cannot encode, each image
is charged once, and entries are freed one plan after the last placeholder token is computed."""

from __future__ import annotations

from steploop.common.block_hashing import block_hashes, hash_block, hash_block_cbor
from steploop.common.mm_inputs import MultiModalFeature
from steploop.common.sampling_params import SamplingParams
from steploop.scheduler.kv_events.recorder import KvEventRecorder
from steploop.scheduler.request import Request
from tests.scheduler.sched_factories import create_scheduler

BS = 4


def feature(image_hash: str, offset: int, length: int) -> MultiModalFeature:
    return MultiModalFeature(image_hash, offset, length, (1, 2, 2 * length), (4 * length, 2), b"\0" * 32 * length)


def request(rid: str, features, n: int = 24, salt: str | None = None) -> Request:
    return Request(rid, list(range(100, 100 + n)), sampling=SamplingParams(max_tokens=2, ignore_eos=True),
                   mm_features=list(features), cache_salt=salt)


def test_blocks_meeting_an_image_are_keyed_by_its_hash():
    tokens = list(range(100, 124))
    for hasher in (hash_block, hash_block_cbor):
        a = block_hashes(tokens, BS, hasher=hasher, images=[("aaa", 6, 8)])     # tokens 6..13: blocks 1, 2, 3
        b = block_hashes(tokens, BS, hasher=hasher, images=[("bbb", 6, 8)])
        again = block_hashes(tokens, BS, hasher=hasher, images=[("aaa", 6, 8)])
        plain = block_hashes(tokens, BS, hasher=hasher)
        assert a == again
        assert a[0] == b[0] == plain[0]                      # before the image: shared
        assert not set(a[1:]) & set(b[1:]) and not set(a[1:]) & set(plain[1:])   # the chain carries it after


def test_kv_events_publish_the_image_hashes_as_vllm_extra_keys():
    recorder = KvEventRecorder()
    r = request("r", [feature("img", 6, 8)], salt="tenant")
    recorder.stored(r, range(5), [bytes([i]) * 32 for i in range(5)], BS)
    (event,) = recorder.pending
    assert event.extra_keys == [("tenant",), ("img",), ("img",), ("img",), None]


def test_encoder_budget_stops_a_chunk_before_an_image_it_cannot_encode():
    sched = create_scheduler(max_num_batched_tokens=64, block_size=BS, max_num_encoder_input_tokens=8)
    r1 = request("r1", [feature("one", 2, 8)])
    r2 = request("r2", [feature("two", 4, 8)])
    sched.add_request(r1)
    sched.add_request(r2)
    plan = sched.schedule()
    # r1 reaches its image (8 of 8 encoder tokens); r2 stops before its own, which waits for the next step
    assert plan.num_scheduled_tokens == [24, 4]
    assert sched.encoder.num_encoded == 1 and not plan.encoder_free_hashes
    next_plan = sched.schedule()
    assert next_plan.encoder_free_hashes == ["one"]          # r1 finished its range last step: freed now
    assert r2.handle in next_plan.scheduled_handles and sched.encoder.num_encoded == 2
    sched.check_integrity()


def test_a_shared_image_is_charged_once_and_freed_when_its_last_user_is_done():
    sched = create_scheduler(max_num_batched_tokens=64, block_size=BS, max_num_encoder_input_tokens=8,
                             long_prefill_token_threshold=6, enable_prefix_caching=False)
    r1, r2 = request("r1", [feature("same", 4, 8)]), request("r2", [feature("same", 4, 8)])
    sched.add_request(r1)
    sched.add_request(r2)
    sched.schedule()                                         # both reach the image (tokens 4..11) mid-range
    assert sched.encoder.num_encoded == 1 and sched.encoder.users == {"same": {"r1", "r2"}}
    assert sched.schedule().encoder_free_hashes == []        # both complete its range in this step ...
    assert sched.schedule().encoder_free_hashes == ["same"]  # ... so the next plan frees it
    sched.check_integrity()


def test_an_aborted_request_releases_its_image():
    sched = create_scheduler(max_num_batched_tokens=10, max_num_seqs=2, block_size=BS,
                             max_num_encoder_input_tokens=8, enable_prefix_caching=False)
    sched.add_request(request("r1", [feature("img", 4, 8)]))
    sched.schedule()                                         # 10 tokens: into the image's range
    assert sched.encoder.users == {"img": {"r1"}}
    sched.abort_requests(["r1"])
    assert sched.schedule().encoder_free_hashes == ["img"] and not sched.encoder.sizes
    sched.check_integrity()
