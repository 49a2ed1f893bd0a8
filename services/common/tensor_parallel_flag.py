"""The `--tensor-parallel-size` / `-tp` flag (vLLM's spelling), shared by serve, the scheduler and the worker."""

from __future__ import annotations

import argparse
import os

from steploop.common.envs import env_name

FLAG = "--tensor-parallel-size"


def add_tensor_parallel_flag(parser: argparse.ArgumentParser) -> None:
    name = env_name(FLAG)
    default = int(os.environ.get(name, "1"))
    parser.add_argument(FLAG, "-tp", type=int, default=default, dest="tensor_parallel_size",
                        help=f"ranks in a tensor-parallel worker group (env {name}; default {default})")


def check_size(size: int) -> None:
    if size < 1:
        raise ValueError(f"{FLAG} {size} must be at least 1")
