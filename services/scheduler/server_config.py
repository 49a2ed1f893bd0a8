"""ServerConfig: the scheduler service's transport and lifecycle settings (scheduling knobs are SchedulerConfig)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from steploop.common import lora_config
from steploop.common.envs import add_flag
from steploop.common.lora_adapter import LoraAdapterError, read_adapter
from steploop.common.lora_config import LoraConfig
from steploop.common.pipeline_parallel_flag import add_pipeline_parallel_flag
from steploop.common.pipeline_parallel_flag import check_size as check_pp_size
from steploop.common.tensor_parallel_flag import add_tensor_parallel_flag, check_size
from steploop.common.tls import TlsConfig

DISAGG_POLICIES = ("cost", "length")     # --disagg-policy (pd_choice.py)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"          # loopback by default: the internal port is not for the internet
    port: int = 50051                # Engine (public token API) and PlanStream (workers) share it
    worker_timeout: float = 120.0    # fail waiting callers with UNAVAILABLE after this long without a worker
    hang_timeout: float = 30.0       # health turns NOT_SERVING when work is pending and no step ends this long
    shutdown_timeout: float = 30.0   # on SIGTERM, in-flight requests get this long to finish
    tls: TlsConfig = field(default_factory=TlsConfig)   # server cert; with a CA, mutual TLS
    lora: LoraConfig = field(default_factory=LoraConfig)   # --enable-lora, --max-loras, --lora-modules, ...
    max_waiting: int = 1024          # new requests are refused (RESOURCE_EXHAUSTED, HTTP 503) while this many wait
    metrics_port: int = 0            # Prometheus /metrics over HTTP (0 = off; Engine.GetMetrics always answers)
    log_stats_interval: float = 10.0  # seconds between engine stats log lines (0 = off)
    tensor_parallel_size: int = 1    # ranks of the worker group; it serves once all have attached
    pipeline_parallel_size: int = 1  # pipeline stages; the group is tp x pp ranks
    tp_collective_timeout: float = 30.0  # a group's collective that takes longer breaks the group
    # Prefill/decode disaggregation (pd_disagg.py, pd_choice.py): where a prompt runs when a prefill group is
    # attached. "cost": the step-cost models price both ways (the length threshold until they have timings);
    # "length": prompts at least disagg_min_prompt_tokens long (0: every prompt). A transfer not confirmed within
    # the lease is recomputed on the decode group.
    disagg_policy: str = "cost"
    disagg_min_prompt_tokens: int = 256
    kv_transfer_lease: float = 60.0
    # The name another replica's scheduler certificate is checked against when this one pulls KV blocks from it
    # (kv_pull_import.py): the gateway hands out the address it dials, a Kubernetes pod IP that no certificate
    # names; "": the address's own host (compose service names, which make-certs.sh puts in the certificate).
    kv_pull_tls_server_name: str = ""

    def validate(self) -> "ServerConfig":
        for name in ("worker_timeout", "hang_timeout", "shutdown_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_waiting < 1:
            raise ValueError(f"--max-waiting must be >= 1, got {self.max_waiting}")
        if not 0 <= self.metrics_port < 65536 or self.log_stats_interval < 0:
            raise ValueError(f"--metrics-port must be in 0..65535 (0 = off) and --log-stats-interval >= 0, got "
                             f"{self.metrics_port} and {self.log_stats_interval}")
        check_size(self.tensor_parallel_size)
        check_pp_size(self.pipeline_parallel_size)
        if self.tp_collective_timeout <= 0:
            raise ValueError(f"--tp-collective-timeout must be > 0 seconds, got {self.tp_collective_timeout}")
        if self.disagg_min_prompt_tokens < 0 or self.kv_transfer_lease <= 0:
            raise ValueError(f"--disagg-min-prompt-tokens must be >= 0 and --kv-transfer-lease > 0 seconds, got "
                             f"{self.disagg_min_prompt_tokens} and {self.kv_transfer_lease}")
        if self.disagg_policy not in DISAGG_POLICIES:
            raise ValueError(f"--disagg-policy {self.disagg_policy!r} must be one of {', '.join(DISAGG_POLICIES)}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--scheduler-port must be in 1..65535, got {self.port}")
        for module in self.lora.lora_modules:     # the scheduler reads the folders: a bad one is a flag to fix
            try:
                read_adapter(module.path, None, self.lora.max_lora_rank)
            except LoraAdapterError as exc:
                raise ValueError(f"--lora-modules {module.name}={module.path}: {exc}") from None
        return self

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        add_flag(parser, "--scheduler-host", default="127.0.0.1", help="address the scheduler's gRPC binds to")
        add_flag(parser, "--scheduler-port", type=int, default=50051,
                 help="gRPC port for the Engine API and the workers' plan streams")
        add_flag(parser, "--worker-timeout", type=float, default=120.0,
                 help="seconds queued requests wait for a worker before failing with UNAVAILABLE")
        add_flag(parser, "--hang-timeout", type=float, default=30.0,
                 help="seconds without a finished step, while work is pending, before health is NOT_SERVING")
        add_flag(parser, "--shutdown-timeout", type=float, default=30.0,
                 help="seconds in-flight requests get to finish after SIGTERM")
        TlsConfig.add_cli_args(parser)
        add_flag(parser, "--max-waiting", type=int, default=1024,
                 help="refuse new requests (RESOURCE_EXHAUSTED; HTTP 503 + Retry-After) while this many wait")
        add_flag(parser, "--metrics-port", type=int, default=0,
                 help="port for the scheduler's Prometheus /metrics (0 = off; the gateway's /metrics has them too)")
        add_flag(parser, "--log-stats-interval", type=float, default=10.0,
                 help="seconds between engine stats log lines, when there was activity (0 = off)")
        add_tensor_parallel_flag(parser)
        add_pipeline_parallel_flag(parser)
        add_flag(parser, "--tp-collective-timeout", type=float, default=30.0,
                 help="seconds a tensor-parallel collective may take before the group counts as broken")
        add_flag(parser, "--disagg-policy", choices=DISAGG_POLICIES, default="cost",
                 help="prefill/decode disaggregation: where a prompt runs when a prefill group (workers started "
                      "with --kv-role prefill) is attached. cost: the cheaper of the two by the step-cost models "
                      "(prompt length less its cached part, both groups' queued prompt work, the running streams "
                      "a local prompt slows, transfer time at the measured bandwidth); length: by "
                      "--disagg-min-prompt-tokens alone. A request's `disaggregation` field forces either")
        add_flag(parser, "--disagg-min-prompt-tokens", type=int, default=256,
                 help="prefill/decode disaggregation: with --disagg-policy length, prompts at least this long run on "
                      "the prefill group (0: every prompt); with cost, the rule for prompt tokens not cached on the "
                      "decode group until the step-cost models have timings")
        add_flag(parser, "--kv-transfer-lease", type=float, default=60.0,
                 help="seconds a disaggregated prompt may take from arrival to its KV blocks confirmed on the "
                      "decode group; past that it is recomputed there")
        add_flag(parser, "--kv-pull-tls-server-name", default="",
                 help="with TLS, the name other replicas' scheduler certificates are checked against when this one "
                      "pulls KV blocks from them (their addresses come from the gateway: behind a Kubernetes "
                      "headless Service, pod IPs no certificate names, so give the Service's name); empty: each "
                      "address's host")
        lora_config.add_cli_args(parser)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerConfig":
        return cls(host=args.scheduler_host, port=args.scheduler_port, worker_timeout=args.worker_timeout,
                   hang_timeout=args.hang_timeout, shutdown_timeout=args.shutdown_timeout,
                   tls=TlsConfig.from_args(args),
                   max_waiting=args.max_waiting, metrics_port=args.metrics_port,
                   log_stats_interval=args.log_stats_interval, tensor_parallel_size=args.tensor_parallel_size,
                   pipeline_parallel_size=args.pipeline_parallel_size,
                   tp_collective_timeout=args.tp_collective_timeout, lora=LoraConfig.from_args(args),
                   disagg_policy=args.disagg_policy, disagg_min_prompt_tokens=args.disagg_min_prompt_tokens,
                   kv_transfer_lease=args.kv_transfer_lease,
                   kv_pull_tls_server_name=args.kv_pull_tls_server_name).validate()
