"""The encoder cache's metrics without a model: queries and hits per image as requests reach it, usage against
the capacity, and their Prometheus families (steploop:encoder_cache_*)."""

from __future__ import annotations

from steploop.scheduler.encoder_metrics import encoder_families
from steploop.scheduler.stats import EngineLoad
from tests.scheduler.sched_factories import create_scheduler
from tests.vlm.test_image_keys_and_budget import BS, feature, request


def load_of(sched) -> EngineLoad:
    """What engine_loop.load_report hands the exporter."""
    e = sched.encoder
    return EngineLoad(counters=sched.counters(), encoder_cache=(e.num_entries, e.used, e.cache_size))


def exported(sched) -> dict[str, float]:
    return {f.name: f.samples[0].value for f in encoder_families(load_of(sched), ["m"])}


def test_a_shared_image_is_one_miss_and_one_hit_and_usage_follows_the_entries():
    sched = create_scheduler(max_num_batched_tokens=64, block_size=BS, max_num_encoder_input_tokens=16,
                             encoder_cache_size=32, long_prefill_token_threshold=6, enable_prefix_caching=False)
    assert exported(sched) == {"steploop:encoder_cache_queries": 0, "steploop:encoder_cache_hits": 0,
                               "steploop:encoder_images_encoded": 0, "steploop:encoder_cache_entries": 0,
                               "steploop:encoder_cache_tokens": 0, "steploop:encoder_cache_capacity_tokens": 32,
                               "steploop:encoder_cache_usage_perc": 0}
    for rid, image in (("r1", "same"), ("r2", "same"), ("r3", "other")):
        sched.add_request(request(rid, [feature(image, 4, 8)]))
    sched.schedule()                      # 6 tokens each: all three reach their image mid-range
    got = exported(sched)
    assert got["steploop:encoder_cache_queries"] == 3 and got["steploop:encoder_cache_hits"] == 1
    assert got["steploop:encoder_images_encoded"] == 2
    assert got["steploop:encoder_cache_entries"] == 2 and got["steploop:encoder_cache_tokens"] == 16
    assert got["steploop:encoder_cache_usage_perc"] == 0.5
    sched.schedule()                      # the rest of each range: no new query (the same requests)
    sched.schedule()                      # the entries are freed
    got = exported(sched)
    assert got["steploop:encoder_cache_queries"] == 3 and got["steploop:encoder_cache_hits"] == 1
    assert got["steploop:encoder_cache_entries"] == 0 and got["steploop:encoder_cache_tokens"] == 0
    sched.check_integrity()


def test_a_request_after_the_entry_was_freed_is_a_miss():
    sched = create_scheduler(max_num_batched_tokens=64, block_size=BS, max_num_encoder_input_tokens=16,
                             enable_prefix_caching=False)
    sched.add_request(request("r1", [feature("img", 4, 8)]))
    sched.schedule()                      # the whole range in one chunk: freed by the next plan
    sched.add_request(request("r2", [feature("img", 4, 8)]))
    sched.schedule()
    counts = sched.counters()
    assert (counts.encoder_queries, counts.encoder_hits, counts.images_encoded) == (2, 0, 2)
