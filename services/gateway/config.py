"""GatewayConfig: everything the gateway is told at start, frozen. Facts learned from the engine at run time
(max_model_len, eos ids) live in `app_state.ModelState`, not here."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from steploop.common import envs, lora_config
from steploop.common.lora_config import LoraConfig
from steploop.common.tls import TlsConfig
from steploop.gateway import cors
from steploop.gateway.cors import CorsPolicy
from steploop.gateway.media import policy as media_policy
from steploop.gateway.media.policy import MediaPolicy
from steploop.gateway.routing.migration import DEFAULT_MAX_MIGRATIONS
from steploop.gateway.routing.kv_pull_cost import KvPullPolicy
from steploop.gateway.text.reasoning import REASONING_PARSERS, get_reasoning_parser
from steploop.gateway.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_PAUSED_REQUEST_TIMEOUT = 30.0
# Batch API limits: OpenAI's own per-file limits (200 MB, 50,000 requests)
DEFAULT_BATCH_MAX_FILE_BYTES = 200 * 1024 * 1024
DEFAULT_BATCH_MAX_LINES = 50_000


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"                   # interface the HTTP server binds
    port: int = 8000                          # 0 = any free port (tests)
    scheduler_address: str = "127.0.0.1:50051"  # host:port of the Engine gRPC service (comma-separated: replicas)
    model: str | None = None                  # model folder; None = the converted default model
    served_model_name: str | None = None      # name clients send as `model`; None = derived from `model`
    api_key: str | None = None                # if set, every /v1 route needs `Authorization: Bearer <key>`
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES  # larger bodies get 413
    shutdown_timeout: float = 30.0            # seconds in-flight requests may take to finish on SIGTERM
    tls: TlsConfig = field(default_factory=TlsConfig)  # client cert + CA for the scheduler link (mutual TLS)
    engine_session: bool = True               # all requests on one Session stream; False: a Generate call each
    tool_call_parser: str = DEFAULT_TOOL_PARSER  # the format the model writes tool calls in (tool_parsers/)
    scheduler_discovery_interval: float = 0.0  # > 0: re-resolve the scheduler names this often (discovery.py)
    reasoning_parser: str | None = None       # --reasoning-parser: how the model writes its thinking (reasoning.py)
    kv_events_routing: bool = True            # route by replicas' KV events where they publish them (kv_index.py)
    max_migrations: int = DEFAULT_MAX_MIGRATIONS  # times one request may move to another replica (migration.py)
    kv_pull: KvPullPolicy = field(default_factory=KvPullPolicy)   # cross-replica KV pulls (kv_pull_cost.py)
    balance_abs_threshold: int = 8            # in-flight gap past which the least loaded replica beats affinity
    lora: LoraConfig = field(default_factory=LoraConfig)   # --enable-lora, --allow-runtime-lora-updating (routes)
    admin_api_key: str | None = None          # set: the engine control routes exist and need this key (admin_auth.py)
    paused_request_timeout: float = DEFAULT_PAUSED_REQUEST_TIMEOUT   # s a new request waits for /resume; 0: 503
    batch_dir: str | None = None              # Batch API files and jobs; None = <cache dir>/batches (batch_api/)
    batch_max_file_bytes: int = DEFAULT_BATCH_MAX_FILE_BYTES   # a larger upload is 413
    batch_max_lines: int = DEFAULT_BATCH_MAX_LINES             # requests in one input file at most
    batch_max_jobs: int = 16                  # batches queued or running at once; more is 429
    batch_concurrency: int = 8                # lines of the running batch in flight at once
    media: MediaPolicy = field(default_factory=MediaPolicy)   # image URLs and base64: fetch limits, SSRF (media/)
    cors: CorsPolicy = field(default_factory=CorsPolicy)      # cross-origin browser calls, as vLLM (cors.py)

    def __post_init__(self) -> None:
        if self.max_request_body_bytes <= 0:
            raise ValueError(f"--max-request-body-bytes must be > 0, got {self.max_request_body_bytes}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        if self.scheduler_discovery_interval < 0:
            raise ValueError(f"--scheduler-discovery-interval must be >= 0 seconds (0: off), "
                             f"got {self.scheduler_discovery_interval}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"--balance-abs-threshold must be >= 0, got {self.balance_abs_threshold}")
        if self.max_migrations < 0:
            raise ValueError(f"--max-migrations must be >= 0 (0: off), got {self.max_migrations}")
        if self.paused_request_timeout < 0:
            raise ValueError(f"--paused-request-timeout must be >= 0 seconds (0: 503 at once), "
                             f"got {self.paused_request_timeout}")
        for name in ("batch_max_file_bytes", "batch_max_lines", "batch_max_jobs", "batch_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.admin_api_key is not None and self.admin_api_key == self.api_key:
            raise ValueError("--admin-api-key must differ from --api-key (a user key must not control the engine)")
        get_reasoning_parser(self.reasoning_parser)   # an unknown name fails at start, listing the known ones
        addresses = self.scheduler_addresses   # any gRPC target: host:port, [::1]:port, unix:path, dns:///...
        if self.scheduler_discovery_interval > 0 and any(
                a.startswith(("unix:", "dns:", "ipv4:", "ipv6:")) or not a.rpartition(":")[2].isdigit()
                for a in addresses):
            raise ValueError(f"--scheduler-discovery-interval re-resolves DNS names: give each --scheduler-address "
                             f"as name:port, got {self.scheduler_address!r}")
        if not addresses or len(set(addresses)) != len(addresses):
            raise ValueError(f"--scheduler-address must be one gRPC address, or several distinct ones separated by "
                             f"commas, got {self.scheduler_address!r}")

    @property
    def scheduler_addresses(self) -> tuple[str, ...]:
        return tuple(a.strip() for a in self.scheduler_address.split(",") if a.strip())

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewayConfig:
        return cls(host=args.host, port=args.port, scheduler_address=args.scheduler_address, model=args.model,
                   served_model_name=args.served_model_name, api_key=args.api_key or None,
                   max_request_body_bytes=args.max_request_body_bytes, shutdown_timeout=args.shutdown_timeout,
                   tls=TlsConfig.from_args(args), engine_session=args.engine_session,
                   tool_call_parser=args.tool_call_parser,
                   scheduler_discovery_interval=args.scheduler_discovery_interval,
                   reasoning_parser=args.reasoning_parser or None, kv_events_routing=args.kv_events_routing,
                   max_migrations=args.max_migrations, kv_pull=KvPullPolicy.from_args(args),
                   balance_abs_threshold=args.balance_abs_threshold, lora=LoraConfig.from_args(args),
                   admin_api_key=args.admin_api_key or None, paused_request_timeout=args.paused_request_timeout,
                   batch_dir=args.batch_dir or None, batch_max_file_bytes=args.batch_max_file_bytes,
                   batch_max_lines=args.batch_max_lines, batch_max_jobs=args.batch_max_jobs,
                   batch_concurrency=args.batch_concurrency, media=MediaPolicy.from_args(args),
                   cors=CorsPolicy.from_args(args))


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the gateway's flags; each defaults to STEPLOOP_<FLAG> when that is set."""
    d = GatewayConfig()
    lora_config.add_cli_args(parser)
    envs.add_flag(parser, "--host", default=d.host, help="interface to bind")
    envs.add_flag(parser, "--port", type=int, default=d.port, help="HTTP port")
    envs.add_flag(parser, "--scheduler-address", default=d.scheduler_address,
                  help="host:port of the scheduler's Engine gRPC service; several, comma-separated, are replicas "
                       "(each with its own workers) that requests are routed across by prefix affinity and load")
    envs.add_flag(parser, "--model", default=None, help="model folder (default: the converted default model)")
    envs.add_flag(parser, "--served-model-name", default=None, help="name clients use as `model`")
    # Not via add_flag: its help text prints the default, and this default is a secret.
    parser.add_argument("--api-key", default=os.environ.get(envs.env_name("--api-key")),
                        help=f"require `Authorization: Bearer <key>` on /v1 routes (env {envs.env_name('--api-key')})")
    parser.add_argument("--admin-api-key", default=os.environ.get(envs.env_name("--admin-api-key")),
                        help="turn on the engine control routes (/pause, /resume, /is_paused, "
                             "/update_weights_from_disk, /get_weight_version, /sleep, /wake_up, /is_sleeping) and "
                             "require `Authorization: Bearer "
                             f"<key>` on them; the --api-key gets 403 there (env {envs.env_name('--admin-api-key')})")
    envs.add_flag(parser, "--paused-request-timeout", type=float, default=d.paused_request_timeout,
                  help="while the engine is paused (POST /pause), a new generation request waits this many seconds "
                       "for POST /resume, then gets 503; 0: 503 at once")
    envs.add_flag(parser, "--batch-dir", default=None,
                  help="where the Batch API (/v1/files, /v1/batches) keeps uploaded files, jobs and their progress; "
                       "one gateway per folder (default: <cache dir>/batches)")
    envs.add_flag(parser, "--batch-max-file-bytes", type=int, default=d.batch_max_file_bytes,
                  help="a larger /v1/files upload is refused (413)")
    envs.add_flag(parser, "--batch-max-lines", type=int, default=d.batch_max_lines,
                  help="requests one batch input file may hold")
    envs.add_flag(parser, "--batch-max-jobs", type=int, default=d.batch_max_jobs,
                  help="batches queued or running at once; one more is refused (429)")
    envs.add_flag(parser, "--batch-concurrency", type=int, default=d.batch_concurrency,
                  help="requests of the running batch in flight at once (each at the lowest priority)")
    envs.add_flag(parser, "--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                  help="larger request bodies are refused with 413")
    envs.add_flag(parser, "--shutdown-timeout", type=float, default=d.shutdown_timeout,
                  help="seconds in-flight requests may take to finish after SIGTERM")
    envs.add_flag(parser, "--engine-session", type=bool, default=d.engine_session,
                  help="carry every request on one multiplexed Session stream to the scheduler (one message per "
                       "step); --no-engine-session gives each request its own Generate call")
    envs.add_flag(parser, "--tool-call-parser", default=d.tool_call_parser,
                  help=f"how the model writes tool calls under tool_choice auto, as vLLM's flag: "
                       f"{', '.join(TOOL_PARSERS)} (hermes: <tool_call> JSON, Qwen 2.5/3 and most tool-tuned "
                       "models; mistral: [TOOL_CALLS]; llama3_json: a JSON object, Llama 3.x; qwen3_coder: "
                       "<function=...> XML, Qwen3-Coder; pythonic: [f(a=1)], Llama 3.2+/4; deepseek_v3, kimi_k2, "
                       "glm45, granite: those families' own; openai: gpt-oss harmony messages)")
    envs.add_flag(parser, "--scheduler-discovery-interval", type=float, default=d.scheduler_discovery_interval,
                  help="every this many seconds, re-resolve each --scheduler-address name:port and route to every "
                       "address it resolves to (a Kubernetes headless Service: scheduler replicas join and leave "
                       "without a restart); 0: resolve once, at start, by gRPC")
    envs.add_flag(parser, "--reasoning-parser", default=None,
                  help=f"split the model's reasoning from its answer, as vLLM's flag: one of {sorted(REASONING_PARSERS)} "
                       "(chat's reasoning_content, Messages' thinking blocks, Responses' reasoning items)")
    envs.add_flag(parser, "--kv-events-routing", type=bool, default=d.kv_events_routing,
                  help="with several scheduler replicas, route by the prefix each one's KV events say it caches "
                       "(schedulers started with --kv-events-config); replicas without events: by guess")
    envs.add_flag(parser, "--max-migrations", type=int, default=d.max_migrations,
                  help="with several scheduler replicas, how many times one request may move to another replica "
                       "when its own dies, drains or its stream breaks mid-generation (it continues from the tokens "
                       "already delivered); 0: never, the request fails")
    envs.add_flag(parser, "--balance-abs-threshold", type=int, default=d.balance_abs_threshold,
                  help="with several scheduler replicas, as SGLang's router: when the replica that caches a "
                       "prompt's prefix has more than this many requests in flight beyond the least loaded one (and "
                       "half as many again), the least loaded one takes it")
    KvPullPolicy.add_cli_args(parser)
    media_policy.add_cli_args(parser)
    cors.add_cli_args(parser)
    TlsConfig.add_cli_args(parser)
    return parser
