"""`steploop serve`: the three services as separate local processes on loopback, supervised.

It takes every gateway, scheduler and worker flag, hands them to the children as STEPLOOP_* variables (each
service reads its flags from there), converts the default model on first use, waits until /health answers 200,
restarts a service that dies, and stops them all on Ctrl-C or SIGTERM (the same ordered drain for both; see
supervisor.py). It starts its own scheduler, so it has no --scheduler-address: it refuses that flag.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import time

from steploop.common import envs, lora_config, model_path, observability
from steploop.common.log import setup_logging
from steploop.serve_ports import check_ports_free, serve_ports
from steploop.supervisor import ServiceSpec, Supervisor

log = logging.getLogger("steploop.serve")
SERVE_METRICS_PORT = 9091   # the scheduler's own /metrics (each service alone defaults to off)


def build_parser() -> argparse.ArgumentParser:
    from steploop.gateway.config import add_cli_args as gateway_args
    from steploop.gpu_worker.config import add_cli_args as worker_args
    from steploop.scheduler.server import add_cli_args as scheduler_args

    parser = argparse.ArgumentParser(prog="steploop serve", conflict_handler="resolve",
                                     description="Run gateway, scheduler and one worker on this machine.",
                                     epilog="Ctrl-C or SIGTERM stops them in order (the gateway finishes in-flight "
                                            "streams first); a second one stops at once. The ports they bind: "
                                            "--port, --scheduler-port, --metrics-port, --worker-metrics-port.")
    # The worker's --metrics-port alias goes first, so the scheduler's --metrics-port wins it here.
    for add in (worker_args, observability.add_worker_metrics_arg, scheduler_args, gateway_args,
                observability.add_cli_args):
        add(parser)
    if envs.env_name("--metrics-port") not in os.environ:   # the embedded cluster exposes scheduler metrics
        metrics_port = next(a for a in parser._actions if a.dest == "metrics_port")
        metrics_port.default = SERVE_METRICS_PORT
        metrics_port.help = metrics_port.help.replace("default 0)", f"default {SERVE_METRICS_PORT} here)")
    envs.add_flag(parser, "--disaggregated-prefill", type=bool, default=False,
                  help="start a second worker group as the scheduler's prefill group (--kv-role prefill) and the "
                       "first as its decode group (--kv-role decode; needs --kv-offloading-size for received blocks), "
                       "each of -tp ranks: the prompts --disagg-policy sends there are computed there and their KV "
                       "sent over TCP")
    envs.add_flag(parser, "--ready-timeout", type=float, default=600.0,
                  help="seconds to wait for the whole path to answer /health before giving up")
    # Replaces the gateway's and worker's --scheduler-address (conflict_handler="resolve"), hidden from --help.
    parser.add_argument("--scheduler-address", action=RefuseSchedulerAddress, help=argparse.SUPPRESS)
    return parser


class RefuseSchedulerAddress(argparse.Action):
    """serve points gateway and worker at the scheduler it starts; another address would be silently replaced."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error("--scheduler-address is not a serve flag: serve starts its own scheduler (move it with "
                     "--scheduler-host/--scheduler-port) and points the gateway and worker at it. To use a "
                     "scheduler that runs elsewhere, start `steploop gateway --scheduler-address HOST:PORT` and "
                     "`steploop worker --scheduler-address HOST:PORT` instead of serve")


def own_scheduler_address(args: argparse.Namespace) -> str:
    """Where gateway and worker reach the scheduler serve starts. STEPLOOP_SCHEDULER_ADDRESS, if set for
    standalone services, does not apply here: said once, not silently."""
    host = "127.0.0.1" if args.scheduler_host in ("0.0.0.0", "::", "") else args.scheduler_host
    address = f"{host}:{args.scheduler_port}"
    inherited = os.environ.get(envs.env_name("--scheduler-address"), "").strip()
    if inherited not in ("", address):
        log.warning("%s=%s is ignored: serve's gateway and worker use the scheduler it starts, %s",
                    envs.env_name("--scheduler-address"), inherited, address)
    return address


def child_environment(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """Every parsed flag as STEPLOOP_<FLAG> (the scheduler address is serve's own, see own_scheduler_address)."""
    env = dict(os.environ)
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help",):
            continue
        value = getattr(args, action.dest, None)
        if action.dest == "lora_modules" and value is not None:   # a JSON list (lora_config.py reads it back)
            env[envs.env_name(action.option_strings[0])] = lora_config.env_value(value)
        elif isinstance(value, list):       # --allowed-media-domains: a JSON list of strings (media/policy.py)
            env[envs.env_name(action.option_strings[0])] = json.dumps([str(v) for v in value])
        elif value is not None:
            env[envs.env_name(action.option_strings[0])] = str(value)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def validate_configs(args: argparse.Namespace) -> None:
    """Every service's config from the same flags, before any process starts: a bad flag is one clear message,
    not a service that exits and is restarted in a loop."""
    from steploop.gateway.config import GatewayConfig
    from steploop.gpu_worker.config import WorkerConfig
    from steploop.scheduler.config import SchedulerConfig
    from steploop.scheduler.server_config import ServerConfig

    if args.scheduler_address is None:       # not parsed by main() (tests): the address serve would give its children
        args.scheduler_address = own_scheduler_address(args)
    for config in (SchedulerConfig, ServerConfig, WorkerConfig, GatewayConfig):
        config.from_args(args)
    if getattr(args, "disaggregated_prefill", False):
        if args.kv_role:
            raise ValueError("--disaggregated-prefill sets each worker's --kv-role itself; drop --kv-role")
        if getattr(args, "pipeline_parallel_size", 1) != 1 or args.kv_offloading_size <= 0:
            raise ValueError("--disaggregated-prefill needs -pp 1 and --kv-offloading-size > 0 (the decode group "
                             "receives the prompt's blocks into host memory, checked, before its pool loads them)")
    observability.validate(args)
    check_ports_free(serve_ports(args))


def ensure_model(model: str | None) -> None:
    if model_path.is_gguf(model) and not model_path.is_model_dir(model_path.gguf_model_dir(model)):
        log.info("converting %s (first start only)", model)
        subprocess.run([sys.executable, "-m", "steploop.gpu_worker.gguf_convert", model], check=True)
    if model and model != model_path.DEFAULT_MODEL:
        model_path.resolve_model(model)          # fails early, with the reason, if the folder is wrong
        return
    if not model_path.is_model_dir(model_path.default_model_dir()):
        log.info("converting the default model (first start only, about a minute on 2 cores)")
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "steploop.gpu_worker.gguf_convert"], check=True)
        log.info("converted the default model in %.0f s", time.monotonic() - started)


def check_tensor_parallel(args: argparse.Namespace) -> None:
    """-tp N / -pp N whose shapes cannot split: refused from config.json, before any process starts or weight
    loads."""
    pp = getattr(args, "pipeline_parallel_size", 1)
    if args.tensor_parallel_size == 1 and pp == 1:
        return
    from steploop.gpu_worker.distributed.pipeline import stage_layers
    from steploop.gpu_worker.distributed.shapes import check_splittable
    from steploop.gpu_worker.model.model_config import ModelConfig
    cfg = ModelConfig.from_dir(model_path.resolve_model(args.model))
    check_splittable(cfg, args.tensor_parallel_size, args.enable_expert_parallel)
    stage_layers(cfg.num_hidden_layers, pp)


def worker_specs(args: argparse.Namespace, env: dict[str, str]) -> list[ServiceSpec]:
    """One worker per rank: rank R gets STEPLOOP_RANK=R, its own metrics port, and its share of the CPUs. With
    --disaggregated-prefill, -tp N ranks in each of two groups: the decode group (--kv-role decode, the host tier
    received blocks land in) and the prefill group (--kv-role prefill, no tiers)."""
    size = args.tensor_parallel_size * getattr(args, "pipeline_parallel_size", 1)
    if not getattr(args, "disaggregated_prefill", False):
        return _rank_specs(args, env, size, "worker", 0, size)
    role = envs.env_name("--kv-role")
    prefill_env = dict(env, **{role: "prefill", envs.env_name("--kv-offloading-size"): "0",
                               envs.env_name("--kv-disk-path"): "", envs.env_name("--kv-disk-size"): "0"})
    return [*_rank_specs(args, dict(env, **{role: "decode"}), size, "worker", 0, 2 * size),
            *_rank_specs(args, prefill_env, size, "worker-prefill", size, 2 * size)]


def _rank_specs(args: argparse.Namespace, env: dict[str, str], size: int, name: str, port_offset: int,
                processes: int) -> list[ServiceSpec]:
    """A group's ranks, named `name` (rank 0) and `name-R`; metrics ports from --worker-metrics-port +
    port_offset; each gets the CPUs split over every worker process serve starts."""
    specs = []
    for rank in range(size):
        rank_env = dict(env, **({envs.env_name("--rank"): str(rank)} if size > 1 else {}))
        if args.worker_metrics_port:
            rank_env[envs.env_name("--worker-metrics-port")] = str(args.worker_metrics_port + port_offset + rank)
        if args.num_threads is None and processes > 1:
            rank_env[envs.env_name("--num-threads")] = str(max(1, len(os.sched_getaffinity(0)) // processes))
        specs.append(ServiceSpec(name if rank == 0 else f"{name}-{rank}", [sys.executable, "-m",
                                                                           "steploop.gpu_worker"], rank_env))
    return specs


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    os.environ[envs.LOG_FORMAT] = args.log_format
    setup_logging("serve")
    args.scheduler_address = own_scheduler_address(args)
    try:
        validate_configs(args)
    except ValueError as exc:            # a flag to change: exit 2, as argparse and the services do
        parser.exit(2, f"steploop serve: {exc}\n")
    try:
        ensure_model(args.model)
        check_tensor_parallel(args)
    except (model_path.ModelNotFoundError, subprocess.CalledProcessError) as exc:
        sys.exit(f"steploop serve: {exc}")
    except ValueError as exc:            # -tp N the model's shapes cannot split
        parser.exit(2, f"steploop serve: {exc}\n")
    except KeyboardInterrupt:            # Ctrl-C during the conversion: nothing else was started yet
        sys.exit(130)
    env = child_environment(parser, args)
    workers = worker_specs(args, env)
    specs = [ServiceSpec("scheduler", [sys.executable, "-m", "steploop.scheduler"], env), *workers,
             ServiceSpec("gateway", [sys.executable, "-m", "steploop.gateway"], env)]
    url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
    supervisor = Supervisor(specs, health_url=f"{url}/health", ready_timeout=args.ready_timeout,
                            stop_timeout=args.shutdown_timeout + 5, stop_order=["gateway", "scheduler", *(w.name for w in workers)])
    started = time.monotonic()
    name = args.served_model_name or model_path.served_model_name(args.model, model_path.resolve_model(args.model))
    code = asyncio.run(supervisor.run(on_ready=lambda: log.info(
        "ready in %.1f s: OpenAI API at %s/v1, model %r (Ctrl-C stops, after in-flight requests finish)",
        time.monotonic() - started, url, name)))
    sys.exit(code)
