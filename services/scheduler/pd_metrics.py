"""Prefill/decode disaggregation as Prometheus families (pd_disagg.PdStats): transfers, bytes, failures,
fallbacks to local recompute, transfer time, and the prefill pool; and cross-replica pulls (kv_pull_import.py)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from steploop.scheduler.stats import EngineLoad

_FAMILIES = (
    ("steploop:pd_disaggregated_requests", "Requests whose prompt ran on the prefill group.", "disaggregated",
     CounterMetricFamily),
    ("steploop:pd_kv_transfers", "KV transfers the decode worker confirmed (every block checksum verified).",
     "transfers", CounterMetricFamily),
    ("steploop:pd_kv_transfer_failures", "KV transfers that failed, timed out, or arrived corrupted.",
     "transfer_failures", CounterMetricFamily),
    ("steploop:pd_fallbacks", "Disaggregated requests recomputed on the decode group instead.", "fallbacks",
     CounterMetricFamily),
    ("steploop:pd_local_requests", "Requests run on the decode group alone while a prefill group was attached "
     "(short prompts, forced local, LoRA, prompt logprobs, resumed).", "local", CounterMetricFamily),
    ("steploop:pd_kv_transfer_bytes", "Bytes of confirmed KV transfers.", "bytes", CounterMetricFamily),
    ("steploop:pd_kv_transfer_seconds", "Prefill-worker time spent sending KV blocks.", "transfer_seconds",
     CounterMetricFamily),
    ("steploop:pd_prefill_group_up", "1 while a prefill group is attached.", "prefill_up", GaugeMetricFamily),
    ("steploop:pd_prefill_requests", "Requests whose prompt is on the prefill group now.", "prefill_requests",
     GaugeMetricFamily),
    ("steploop:pd_prefill_free_blocks", "Free KV blocks of the prefill group's pool.", "prefill_free_blocks",
     GaugeMetricFamily),
    ("steploop:pd_prefill_total_blocks", "Usable KV blocks of the prefill group's pool.", "prefill_total_blocks",
     GaugeMetricFamily),
)

_PULL_FAMILIES = (
    ("steploop:kv_pull_requests", "Requests that asked another replica for their cached prefix (a router hint).",
     "pulls", CounterMetricFamily),
    ("steploop:kv_pull_successes", "Of them, those whose blocks arrived with every checksum verified.", "pulled",
     CounterMetricFamily),
    ("steploop:kv_pull_blocks", "KV blocks pulled from other replicas.", "blocks", CounterMetricFamily),
    ("steploop:kv_pull_bytes", "Bytes of KV blocks pulled from other replicas.", "bytes", CounterMetricFamily),
    ("steploop:kv_pull_fallbacks", "Pulls recomputed instead (source gone, blocks evicted there, a send or receive "
     "failed, or this replica cannot receive).", "failures", CounterMetricFamily),
    ("steploop:kv_pull_seconds", "Time from asking the source replica to its answer, summed.", "seconds",
     CounterMetricFamily),
    ("steploop:kv_pull_exports", "This replica's blocks sent to another replica (exports acknowledged).", "exports",
     CounterMetricFamily),
    ("steploop:kv_pull_export_blocks", "KV blocks this replica sent to other replicas.", "export_blocks",
     CounterMetricFamily),
)


def pd_families(load: EngineLoad, labels: list[str]) -> Iterator:
    for stats, families in ((load.pd, _FAMILIES), (load.kv_pull, _PULL_FAMILIES)):
        if stats is None:
            continue
        for name, doc, field, kind in families:
            family = kind(name, doc, labels=["model_name"])
            family.add_metric(labels, float(getattr(stats, field)))
            yield family
    if load.pd is not None and load.pd.decisions:
        family = CounterMetricFamily("steploop:pd_decisions", "Where prompts ran, by choice (disaggregated, local) "
                                     "and reason (forced, down, unsupported, short, cached, cost, threshold, length; "
                                     "pd_choice.py).", labels=["model_name", "choice", "reason"])
        for (choice, reason), count in sorted(load.pd.decisions.items()):
            family.add_metric([*labels, choice, reason], float(count))
        yield family
