"""KV tiers below the pool as Prometheus families, one sample per medium ("CPU" host memory, "DISK"), beside
vLLM's prefix-cache counters (vllm:prefix_cache_queries / _hits count the pool; these count each lower medium)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from steploop.scheduler.stats import EngineLoad

_FAMILIES = (
    ("steploop:kv_tier_queries", "Tokens looked up in a KV medium below the pool (past the media above it).",
     "queries", CounterMetricFamily),
    ("steploop:kv_tier_hits", "Tokens restored from a KV medium below the pool instead of recomputed.", "hits",
     CounterMetricFamily),
    ("steploop:kv_tier_bytes_moved", "Bytes written to or read from a KV medium below the pool.", "bytes_moved",
     CounterMetricFamily),
    ("steploop:kv_tier_restore_seconds", "Worker time of the steps' moves that restored blocks from a medium.",
     "restore_seconds", CounterMetricFamily),
    ("steploop:kv_tier_misses", "Blocks a medium failed to read back (absent, corrupt, foreign) or to write.",
     "misses", CounterMetricFamily),
    ("steploop:kv_tier_used_blocks", "KV blocks a medium below the pool holds now.", "used_blocks",
     GaugeMetricFamily),
    ("steploop:kv_tier_capacity_blocks", "KV blocks a medium below the pool can hold.", "capacity_blocks",
     GaugeMetricFamily),
)


def kv_tier_families(load: EngineLoad, labels: list[str]) -> Iterator:
    if not load.kv_tiers:
        return
    for name, doc, field, kind in _FAMILIES:
        family = kind(name, doc, labels=["model_name", "medium"])
        for tier in load.kv_tiers:
            family.add_metric(labels + [tier.medium], getattr(tier, field))
        yield family
