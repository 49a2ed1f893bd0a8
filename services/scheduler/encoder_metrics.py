"""The encoder cache of vision-language models as Prometheus families (encoder_budget.py keeps the counts).

vLLM exports no encoder-cache family (its vllm:mm_cache_* count the API server's processor cache, another cache),
so these are steploop:* names: queries and hits in images, usage in embeddings (one per image placeholder token)
against --encoder-cache-size. A text-only model shows zeros."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from steploop.scheduler.stats import EngineLoad

MODEL = ["model_name"]


def encoder_families(load: EngineLoad, labels: list[str]) -> Iterator:
    counts = load.counters
    entries, used, capacity = load.encoder_cache
    for name, doc, value, kind in (
            ("steploop:encoder_cache_queries", "Images a prompt chunk reached (each request's first chunk per image).",
             counts.encoder_queries, CounterMetricFamily),
            ("steploop:encoder_cache_hits", "Of those, images whose embeddings the encoder cache already held.",
             counts.encoder_hits, CounterMetricFamily),
            ("steploop:encoder_images_encoded", "Images sent to the vision encoder.", counts.images_encoded,
             CounterMetricFamily),
            ("steploop:encoder_cache_entries", "Images whose embeddings the encoder cache holds now.", entries,
             GaugeMetricFamily),
            ("steploop:encoder_cache_tokens", "Embeddings (image placeholder tokens) the encoder cache holds now.",
             used, GaugeMetricFamily),
            ("steploop:encoder_cache_capacity_tokens", "Embeddings the encoder cache may hold (--encoder-cache-size).",
             capacity, GaugeMetricFamily),
            ("steploop:encoder_cache_usage_perc", "Encoder-cache usage. 1 means 100 percent usage.",
             used / capacity if capacity else 0.0, GaugeMetricFamily)):
        family = kind(name, doc, labels=MODEL)
        family.add_metric(labels, float(value))
        yield family
