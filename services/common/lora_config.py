"""LoRA flags, as vLLM spells them, shared by the three services (serve hands them to each as STEPLOOP_*).

    --enable-lora                     serve adapters at all (off: a step never looks at adapters)
    --max-loras N                     distinct adapters in one step (the worker's slot table on the device)
    --max-lora-rank R                 the highest rank an adapter may have (the slot table's width)
    --max-cpu-loras N                 adapters the worker keeps loaded in host memory (LRU; >= --max-loras)
    --lora-modules name=path ...      adapters served from the start; also vLLM's JSON form
                                      '{"name": "sql", "path": "/adapters/sql", "base_model_name": "..."}'
    --allow-runtime-lora-updating     POST /v1/load_lora_adapter and /v1/unload_lora_adapter answer (else 404)
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field

from steploop.common import envs


@dataclass(frozen=True)
class LoraModule:
    name: str
    path: str


@dataclass(frozen=True)
class LoraConfig:
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None     # None: max_loras
    lora_modules: tuple[LoraModule, ...] = field(default_factory=tuple)
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"--max-loras {self.max_loras} must be >= 1")
        if self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank {self.max_lora_rank} must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras {self.max_cpu_loras} must be >= --max-loras {self.max_loras}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names an adapter twice: {names}")

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LoraConfig:
        return cls(enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                   max_cpu_loras=args.max_cpu_loras, lora_modules=tuple(args.lora_modules or ()),
                   allow_runtime_lora_updating=args.allow_runtime_lora_updating)


def parse_lora_module(text: str) -> LoraModule:
    """name=path, or vLLM's JSON object {"name": ..., "path": ...}."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
            return LoraModule(str(obj["name"]), str(obj["path"]))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: expected JSON with name and path ({exc})")
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: expected name=path")
    return LoraModule(name, path)


def _modules_from_env() -> list[LoraModule] | None:
    """STEPLOOP_LORA_MODULES: a JSON list (what serve writes) of name=path strings or JSON objects."""
    raw = os.environ.get(envs.env_name("--lora-modules"))
    if not raw:
        return None
    items = json.loads(raw) if raw.lstrip().startswith("[") else raw.split()
    return [parse_lora_module(json.dumps(i) if isinstance(i, dict) else str(i)) for i in items]


def env_value(modules: list[LoraModule]) -> str:
    """How serve hands --lora-modules to its children (read back by _modules_from_env)."""
    return json.dumps([f"{m.name}={m.path}" for m in modules])


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    envs.add_flag(parser, "--enable-lora", type=bool, default=False, help="serve LoRA adapters")
    envs.add_flag(parser, "--max-loras", type=int, default=1, help="distinct LoRA adapters in one step")
    envs.add_flag(parser, "--max-lora-rank", type=int, default=16, help="highest LoRA rank served")
    envs.add_flag(parser, "--max-cpu-loras", type=int, default=None,
                  help="LoRA adapters the worker keeps loaded in host memory (default --max-loras)")
    parser.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=_modules_from_env(),
                        help="adapters served from the start: name=path or JSON {\"name\", \"path\"} "
                             f"(env {envs.env_name('--lora-modules')}, a JSON list)")
    envs.add_flag(parser, "--allow-runtime-lora-updating", type=bool, default=False,
                  help="answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
