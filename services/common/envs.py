"""Every environment variable steploop reads, in one registry, all prefixed STEPLOOP_.

A command-line flag `--max-num-seqs` defaults to `STEPLOOP_MAX_NUM_SEQS` when that is set, so containers and
`steploop serve` configure services the same way. Use `add_flag` instead of `parser.add_argument` for that.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

PREFIX = "STEPLOOP_"

# Variables that are not flags.
CACHE_DIR = PREFIX + "CACHE_DIR"      # converted models, compiled CPU kernels (default ~/.cache/steploop)
LOG_LEVEL = PREFIX + "LOG_LEVEL"      # DEBUG, INFO (default), WARNING
LOG_FORMAT = PREFIX + "LOG_FORMAT"    # text (default) or json; also every service's --log-format
CPU_KERNELS = PREFIX + "CPU_KERNELS"                     # 0: no C kernel on the CPU at all (plain torch, the reference)
CPU_ATTENTION_KERNEL = PREFIX + "CPU_ATTENTION_KERNEL"   # 0: the torch backend skips the fused C kernel on the CPU
CPU_PACKED_WEIGHTS = PREFIX + "CPU_PACKED_WEIGHTS"       # 0: CPU fp32 linears stay torch matmuls (no packed kernel)
CPU_DECODER = PREFIX + "CPU_DECODER"                     # 0: CPU decode steps run layer by layer from Python
CPU_HUGEPAGES = PREFIX + "CPU_HUGEPAGES"                 # 0: the CPU KV cache stays in 4 KiB pages (no MADV_HUGEPAGE)
CPU_KERNEL_PROBE = PREFIX + "CPU_KERNEL_PROBE"           # 0: keep the packed matmul without timing it against torch at start
KV_EVENTS_INT_BLOCK_HASHES = PREFIX + "KV_EVENTS_INT_BLOCK_HASHES"  # 0: ZMQ KV events carry 32-byte keys, not vLLM's 64-bit ints
CPU_ISA = PREFIX + "CPU_ISA"                             # avx512 / avx2 / generic: the C kernels' instruction set (default: the best the CPU has)
CPU_TUNING = PREFIX + "CPU_TUNING"                         # vendor / constants / caches: the packed matmul's blocking (cpu_tuning.py)
CPU_ADAPTIVE_THREADS = PREFIX + "CPU_ADAPTIVE_THREADS"   # 0: the worker keeps its thread count (no probing of fewer)
WORKER_OVERLAP = PREFIX + "WORKER_OVERLAP"                 # 0: a GPU worker finishes each step before it launches the next (step_overlap.py)
SCHEDULER_C_LOOPS = PREFIX + "SCHEDULER_C_LOOPS"           # 0: the scheduler's plain-decode loops stay Python (no gcc build)
SCHEDULER_GC_TUNING = PREFIX + "SCHEDULER_GC_TUNING"       # 0: the scheduler keeps CPython's GC thresholds (no freeze)
TEST_CORRUPT_KV_TRANSFER = PREFIX + "TEST_CORRUPT_KV_TRANSFER"   # test hook, 1: a prefill worker flips a byte of each transfer's first block after its checksum


def switched_off(*names: str) -> str | None:
    """The first of these variables set to 0/false/no/off (then the feature they guard is off), else None."""
    for name in names:
        if os.environ.get(name, "1").lower() in ("0", "false", "no", "off"):
            return name
    return None


def env_name(flag: str) -> str:
    return PREFIX + flag.lstrip("-").replace("-", "_").upper()


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0/true/false), got {text!r}")


def add_flag(parser: argparse.ArgumentParser | Any, flag: str, *, type: Any = str, default: Any = None,
             help: str = "", **kwargs: Any) -> None:
    """parser.add_argument whose default comes from STEPLOOP_<FLAG> when set. type=bool makes an on/off pair."""
    name = env_name(flag)
    raw = os.environ.get(name)
    if type is bool:
        value = _parse_bool(raw) if raw is not None else bool(default)
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value,
                            help=f"{help} (env {name}; default {value})", **kwargs)
        return
    value = type(raw) if raw is not None else default
    parser.add_argument(flag, type=type, default=value, help=f"{help} (env {name}; default {value})", **kwargs)
