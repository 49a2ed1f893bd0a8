"""The observability flags every service takes (--log-format, --otlp-traces-endpoint, --disable-log-stats) and
one call that applies them: logging first, then metrics on or off, then tracing."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from steploop.common import envs, metrics, tracing
from steploop.common.log import LOG_FORMATS, setup_logging


def add_cli_args(parser: argparse.ArgumentParser | Any) -> argparse.ArgumentParser | Any:
    envs.add_flag(parser, "--log-format", default="text", choices=LOG_FORMATS,
                  help="text: one readable line per record; json: one JSON object per line")
    envs.add_flag(parser, "--otlp-traces-endpoint", default="",
                  help="OTLP/gRPC collector (e.g. http://127.0.0.1:4317) to export traces to; empty = tracing off")
    envs.add_flag(parser, "--disable-log-stats", type=bool, default=False,
                  help="record no metrics (/metrics answers with no samples) and log no per-request or periodic "
                       "stats lines, as vLLM's flag; not with --otlp-traces-endpoint (spans need those hooks)")
    return parser


def validate(args: argparse.Namespace) -> None:
    """ValueError for flags that cannot go together."""
    if getattr(args, "disable_log_stats", False) and getattr(args, "otlp_traces_endpoint", ""):
        raise ValueError("--disable-log-stats turns off the hooks tracing needs: drop it or --otlp-traces-endpoint")


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
    try:
        validate(args)
    except ValueError as exc:            # a configuration error: exit 2, which `steploop serve` does not restart
        print(f"steploop {service}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    metrics.ENABLED = not getattr(args, "disable_log_stats", False)
    tracing.setup_tracing(service, getattr(args, "otlp_traces_endpoint", ""))
