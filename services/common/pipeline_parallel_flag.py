"""The `--pipeline-parallel-size` / `-pp` flag (vLLM's spelling), shared by serve, the scheduler and the worker.

A group is tp x pp ranks: rank r is tensor-parallel rank r % tp of pipeline stage r // tp."""

from __future__ import annotations

import argparse
import os

from steploop.common.envs import env_name

FLAG = "--pipeline-parallel-size"


def add_pipeline_parallel_flag(parser: argparse.ArgumentParser) -> None:
    name = env_name(FLAG)
    default = int(os.environ.get(name, "1"))
    parser.add_argument(FLAG, "-pp", type=int, default=default, dest="pipeline_parallel_size",
                        help=f"pipeline stages, each a contiguous slice of the layers on its own ranks; a group is "
                             f"-tp x -pp ranks (env {name}; default {default})")


def check_size(size: int) -> None:
    if size < 1:
        raise ValueError(f"{FLAG} {size} must be at least 1")
