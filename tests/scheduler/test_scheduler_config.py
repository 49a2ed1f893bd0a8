"""SchedulerConfig: defaults, CLI flags with STEPLOOP_ env defaults, errors that say how to fix them."""

from __future__ import annotations

import argparse

import pytest

from steploop.scheduler.config import SchedulerConfig, SchedulerConfigError


def test_defaults():
    c = SchedulerConfig()
    assert (c.max_num_batched_tokens, c.max_num_seqs, c.long_prefill_token_threshold) == (2048, 128, 0)


def test_flags_and_env(monkeypatch):
    monkeypatch.setenv("STEPLOOP_MAX_NUM_SEQS", "7")
    parser = argparse.ArgumentParser()
    SchedulerConfig.add_cli_args(parser)
    c = SchedulerConfig.from_args(parser.parse_args(["--max-num-batched-tokens", "64",
                                                     "--long-prefill-token-threshold", "16"]))
    assert c == SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=7, long_prefill_token_threshold=16)


@pytest.mark.parametrize("kwargs, fix", [
    ({"max_num_batched_tokens": 0}, "--max-num-batched-tokens"),
    ({"max_num_seqs": 0}, "--max-num-seqs"),
    ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "raise --max-num-batched-tokens"),
    ({"long_prefill_token_threshold": -1}, "--long-prefill-token-threshold"),
])
def test_errors_print_values_and_fix(kwargs, fix):
    with pytest.raises(SchedulerConfigError) as err:
        SchedulerConfig(**kwargs)
    assert fix in str(err.value)
    assert all(f"{k}={v}" in str(err.value) for k, v in kwargs.items())
