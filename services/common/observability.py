"""The observability flags every service takes (--log-format, --otlp-traces-endpoint) and one call that
applies them: logging first, then tracing."""

from __future__ import annotations

import argparse
import os
from typing import Any

from services.common import envs, tracing
from services.common.log import LOG_FORMATS, setup_logging


def add_cli_args(parser: argparse.ArgumentParser | Any) -> argparse.ArgumentParser | Any:
    envs.add_flag(parser, "--log-format", default="text", choices=LOG_FORMATS,
                  help="text: one readable line per record; json: one JSON object per line")
    envs.add_flag(parser, "--otlp-traces-endpoint", default="",
                  help="OTLP/gRPC collector (e.g. http://127.0.0.1:4317) to export traces to; empty = tracing off")
    return parser


def add_worker_metrics_arg(parser: argparse.ArgumentParser | Any) -> None:
    """The worker's own /metrics port. Its env name (STEPLOOP_WORKER_METRICS_PORT) differs from the scheduler's
    --metrics-port, so `steploop serve` can hand both to its children."""
    name = envs.env_name("--worker-metrics-port")
    default = int(os.environ.get(name, "0"))
    parser.add_argument("--worker-metrics-port", "--metrics-port", dest="worker_metrics_port", type=int,
                        default=default, help=f"port for the worker's Prometheus /metrics; 0 = off "
                                              f"(env {name}; default {default})")


def setup(service: str, args: argparse.Namespace) -> None:
    os.environ[envs.LOG_FORMAT] = getattr(args, "log_format", None) or os.environ.get(envs.LOG_FORMAT, "text")
    setup_logging(service)
    tracing.setup_tracing(service, getattr(args, "otlp_traces_endpoint", ""))
