"""SchedulerConfig: the scheduler's knobs, frozen once the service starts.

Facts learned at run time (max_model_len, number of KV blocks, block size) come from the worker's hello and live
in scheduler state, never here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from services.common import envs


class SchedulerConfigError(ValueError):
    """A config value is out of range; the message says which value and how to fix it."""


@dataclass(frozen=True)
class SchedulerConfig:
    # Tokens scheduled per step at most, summed over every request in the batch (prompt chunks + decodes).
    max_num_batched_tokens: int = 2048
    # Requests running at once at most (the batch size for decode-only steps).
    max_num_seqs: int = 128
    # A request gets at most this many tokens in one step, so one long prompt cannot starve others. 0 = off.
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise SchedulerConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1; "
                "set --max-num-batched-tokens (or STEPLOOP_MAX_NUM_BATCHED_TOKENS) to e.g. 2048")
        if self.max_num_seqs < 1:
            raise SchedulerConfigError(
                f"max_num_seqs={self.max_num_seqs} must be >= 1; set --max-num-seqs (or STEPLOOP_MAX_NUM_SEQS) "
                "to e.g. 128")
        if self.max_num_seqs > self.max_num_batched_tokens:
            # Every running request needs at least one token per step to decode.
            raise SchedulerConfigError(
                f"max_num_seqs={self.max_num_seqs} > max_num_batched_tokens={self.max_num_batched_tokens}: "
                "a step could not give every running request one token; raise --max-num-batched-tokens "
                "or lower --max-num-seqs")
        if self.long_prefill_token_threshold < 0:
            raise SchedulerConfigError(
                f"long_prefill_token_threshold={self.long_prefill_token_threshold} must be >= 0 (0 = off); "
                "set --long-prefill-token-threshold to 0 or a positive chunk size")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser | Any) -> None:
        d = SchedulerConfig()
        envs.add_flag(parser, "--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                      help="tokens scheduled per step at most (prompt chunks and decodes together)")
        envs.add_flag(parser, "--max-num-seqs", type=int, default=d.max_num_seqs,
                      help="requests running at once at most")
        envs.add_flag(parser, "--long-prefill-token-threshold", type=int, default=d.long_prefill_token_threshold,
                      help="tokens one request may get per step at most; 0 = off")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "SchedulerConfig":
        return cls(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                   long_prefill_token_threshold=args.long_prefill_token_threshold)


# Module-level spellings of the same two functions.
add_cli_args = SchedulerConfig.add_cli_args
from_args = SchedulerConfig.from_args
