"""The attention kernel's launch configurations (num_warps, num_stages) and its shape classes: what plans carry
and the launcher reads. The start-up tuner (tuning.py) picks one per class among CANDIDATES."""

from __future__ import annotations

from dataclasses import dataclass

CLASSES = ("decode", "split", "mixed")
SPLITS = (2, 4, 8, 16)          # every split count choose_num_splits can return besides 1


@dataclass(frozen=True)
class LaunchConfig:
    num_warps: int = 4
    num_stages: int = 2


DEFAULT = LaunchConfig()
CANDIDATES = {
    "decode": (LaunchConfig(4, 2), LaunchConfig(2, 2), LaunchConfig(4, 3), LaunchConfig(8, 2)),
    "split": (LaunchConfig(4, 2), LaunchConfig(2, 2), LaunchConfig(4, 3), LaunchConfig(8, 2)),
    "mixed": (LaunchConfig(4, 2), LaunchConfig(8, 2), LaunchConfig(4, 3), LaunchConfig(8, 3)),
}


def shape_class(max_query_len: int, num_splits: int) -> str:
    if max_query_len > 1:
        return "mixed"
    return "split" if num_splits > 1 else "decode"
