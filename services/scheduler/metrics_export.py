"""EngineObserver's state as Prometheus metric families, built at scrape time (names as vLLM's V1 engine)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from steploop.scheduler.encoder_metrics import encoder_families
from steploop.scheduler.kv_tier_metrics import kv_tier_families
from steploop.scheduler.pd_metrics import pd_families
from steploop.scheduler.lora_metrics import lora_requests_info
from steploop.scheduler.stats import EngineLoad, SchedulerCounters

MODEL = ["model_name"]


def _gauge(name: str, doc: str, labels: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=MODEL)
    family.add_metric(labels, value)
    return family


def _counter(name: str, doc: str, labels: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=MODEL)
    family.add_metric(labels, value)
    return family


def _hist(name: str, doc: str, labels: list[str], hist: Any) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=MODEL)
    hist.add_to(family, labels)
    return family


def families(obs: Any, labels: list[str]) -> Iterator:
    """obs: the EngineObserver (Any: it imports this module)."""
    load = obs.load_report()
    counts = load.counters
    if load.max_loras:
        yield lora_requests_info(load)
    yield _gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels,
                 load.num_running)
    yield _gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels,
                 load.num_waiting)
    yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels,
                 load.kv_cache_usage)
    yield _counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                   labels, counts.prefix_queries)
    yield _counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", labels,
                   counts.prefix_hits)
    yield _counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels,
                   counts.preemptions)
    yield _counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, obs.prompt_tokens)
    yield _counter("vllm:generation_tokens", "Number of generation tokens processed.", labels,
                   obs.generation_tokens)
    success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                  labels=MODEL + ["finished_reason"])
    for reason, n in sorted(obs.success.items()):
        success.add_metric(labels + [reason], n)
    yield success
    yield _hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels,
                obs.ttft)
    yield _hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", labels, obs.itl)
    yield _hist("vllm:time_per_output_token_seconds",
                "Histogram of time per output token in seconds (deprecated: inter_token_latency_seconds).",
                labels, obs.itl)
    yield _hist("vllm:request_time_per_output_token_seconds",
                "Histogram of time_per_output_token_seconds per request.", labels, obs.tpot)
    yield _hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", labels, obs.e2e)
    yield _hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", labels,
                obs.queue)
    yield _hist("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
                labels, obs.inference)
    yield _hist("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                labels, obs.prefill)
    yield _hist("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", labels,
                obs.decode)
    yield _hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", labels,
                obs.iteration_tokens)
    if obs.req_prompt is not None:
        yield _hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", labels, obs.req_prompt)
        yield _hist("vllm:request_generation_tokens", "Number of generation tokens processed.", labels,
                    obs.req_generation)
    yield from _spec_decode(counts, labels)
    worker = obs.worker_info
    if worker is not None and load.num_total_blocks:
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=MODEL + ["block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype"])
        info.add_metric(labels + [str(worker.block_size), str(worker.num_kv_blocks),
                                  str(obs.enable_prefix_caching), _CACHE_DTYPE_FLAG.get(worker.cache_dtype, "auto")],
                        1.0)
        yield info
    yield from _steploop(obs, load, labels)
    yield from _pacing(load, labels)
    yield from kv_tier_families(load, labels)
    yield from pd_families(load, labels)
    yield from encoder_families(load, labels)


# vLLM's label is the --kv-cache-dtype value: "auto" for a cache of the model's dtype
_CACHE_DTYPE_FLAG = {"float8_e4m3fn": "fp8", "float8_e5m2": "fp8_e5m2"}


def _spec_decode(counts: SchedulerCounters, labels: list[str]) -> Iterator:
    yield _counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labels, counts.spec_drafts)
    yield _counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", labels, counts.draft_tokens)
    yield _counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", labels,
                   counts.accepted_tokens)
    drafts = counts.draft_tokens
    yield _gauge("steploop:spec_decode_acceptance_rate", "Accepted / proposed draft tokens since start.", labels,
                 counts.accepted_tokens / drafts if drafts else 0.0)


def _pacing(load: EngineLoad, labels: list[str]) -> Iterator:
    """Prefill pacing (--max-decode-slowdown): how often it held prompt tokens back, and the step-time model."""
    yield _counter("steploop:prefill_paced_steps", "Steps in which prefill pacing cut a prompt chunk.", labels,
                   load.counters.paced_steps)
    yield _counter("steploop:prefill_deferred_tokens", "Per step, prompt tokens the budget allowed but prefill pacing held back, summed.", labels,
                   load.counters.deferred_prompt_tokens)
    coef = load.step_cost
    if coef is not None:
        yield _gauge("steploop:step_cost_base_seconds", "Learned step time with no tokens (a).", labels, coef[0])
        yield _gauge("steploop:step_cost_token_seconds", "Learned step time per scheduled token (b).", labels,
                     coef[1])


def _steploop(obs: Any, load: EngineLoad, labels: list[str]) -> Iterator:
    yield _counter("steploop:steps", "Steps whose result was applied.", labels, obs.num_steps)
    yield _hist("steploop:step_duration_seconds", "Plan sent to its result applied, per step.", labels,
                obs.step_duration)
    yield _hist("steploop:worker_round_trip_seconds",
                "Per step: time outside the worker's forward (transport, (de)serialization, queueing).", labels,
                obs.round_trip)
    yield _hist("steploop:worker_forward_seconds", "Per step: forward + sampling time the worker reported.",
                labels, obs.forward)
    yield _counter("steploop:plan_bytes", "Bytes of StepPlan messages sent to workers.", labels, obs.plan_bytes)
    yield _counter("steploop:resumed_requests", "Requests that arrived with outputs another replica delivered "
                   "(migrated in).", labels, obs.resumed_requests)
    yield _hist("steploop:plan_size_bytes", "Size of one StepPlan message.", labels, obs.plan_size)
    aborts = CounterMetricFamily("steploop:request_aborts", "Requests ended before finishing, by reason.",
                                 labels=MODEL + ["reason"])
    for reason in ("cancelled", "abort_rpc", "no_worker", "rejected", "paused"):
        aborts.add_metric(labels + [reason], obs.aborts[reason])
    yield aborts
    yield _counter("steploop:worker_attaches", "Workers that attached.", labels, obs.attaches)
    yield _counter("steploop:worker_detaches", "Workers that detached (stream broke or replaced).", labels,
                   obs.detaches)
    yield _gauge("steploop:workers_attached", "Workers attached now.", labels, load.workers_attached)
    yield _gauge("steploop:engine_paused", "1 while generation is paused (POST /pause), else 0.", labels,
                 float(load.paused))
    yield _counter("steploop:weight_updates", "Weight updates applied since start (the served weight version "
                   "is GET /get_weight_version).", labels, load.weight_updates)
    version = GaugeMetricFamily("steploop:weight_version_info", "1, labelled with the served weights' version "
                                "(set by each weight update; '0' as loaded at start).", labels=MODEL + ["version"])
    version.add_metric(labels + [load.weight_version], 1.0)
    yield version
