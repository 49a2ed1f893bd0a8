"""vllm:lora_requests_info as vLLM exports it (what Kubernetes inference gateways read to route by adapter): one
gauge sample whose labels carry max_lora and the comma-separated running and waiting adapters, and whose value
is the time of the report (seconds since the epoch)."""

from __future__ import annotations

import time

from prometheus_client.core import GaugeMetricFamily

from steploop.scheduler.stats import EngineLoad


def lora_requests_info(load: EngineLoad) -> GaugeMetricFamily:
    family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                               labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    family.add_metric([str(load.max_loras), ",".join(load.running_lora_adapters),
                       ",".join(load.waiting_lora_adapters)], time.time())
    return family
