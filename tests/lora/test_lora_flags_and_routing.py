"""vLLM's LoRA flags (both --lora-modules forms, through serve's environment hand-off), the router's preference
for replicas that already run an adapter, and block keys that separate adapters."""

from __future__ import annotations

import argparse

import pytest

from steploop.common import envs, lora_config
from steploop.common.block_hashing import block_hashes, first_block_extra
from steploop.common.lora_config import LoraConfig, LoraModule
from steploop.gateway.routing.lora_routing import LoraHomes


def parse(argv, monkeypatch=None):
    parser = argparse.ArgumentParser()
    lora_config.add_cli_args(parser)
    return LoraConfig.from_args(parser.parse_args(argv))


def test_lora_modules_in_both_forms():
    config = parse(["--enable-lora", "--max-loras", "2", "--lora-modules", "sql=/a/sql",
                    '{"name": "chat", "path": "/a/chat", "base_model_name": "x"}'])
    assert config.lora_modules == (LoraModule("sql", "/a/sql"), LoraModule("chat", "/a/chat"))
    assert (config.max_loras, config.cpu_loras, config.max_lora_rank) == (2, 2, 16)


def test_lora_modules_survive_serves_environment(monkeypatch):
    modules = [LoraModule("a", "/x/a"), LoraModule("b", "/x/b")]
    monkeypatch.setenv(envs.env_name("--lora-modules"), lora_config.env_value(modules))
    monkeypatch.setenv(envs.env_name("--enable-lora"), "1")
    assert parse([]).lora_modules == tuple(modules)


@pytest.mark.parametrize("argv, words", [
    (["--lora-modules", "a=/x"], "needs --enable-lora"),
    (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "--max-cpu-loras 2 must be >= --max-loras 4"),
    (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "twice"),
])
def test_bad_lora_flags_say_what_to_fix(argv, words):
    with pytest.raises(ValueError, match=words):
        parse(argv)


def test_the_router_prefers_a_replica_that_ran_the_adapter_unless_it_is_much_busier():
    homes, load = LoraHomes(), {0: 3, 1: 0, 2: 1}
    homes.record("sql", 0)
    assert homes.prefer("sql", 1, [0, 1, 2], load.get, imbalance=8) == 0
    assert homes.prefer("chat", 1, [0, 1, 2], load.get, imbalance=8) == 1      # never seen: routing as usual
    assert homes.prefer("sql", 1, [1, 2], load.get, imbalance=8) == 1          # its home is down
    assert homes.prefer("sql", 1, [0, 1, 2], {0: 20, 1: 0, 2: 1}.get, imbalance=8) == 1   # too busy
    homes.forget("sql")
    assert homes.prefer("sql", 1, [0, 1, 2], load.get, imbalance=8) == 1


def test_block_keys_differ_per_adapter_and_keep_the_base_keys():
    tokens = list(range(64))
    base = block_hashes(tokens, 16, "salt")
    assert block_hashes(tokens, 16, first_block_extra("salt", None)) == base
    a, b = (block_hashes(tokens, 16, first_block_extra("salt", n)) for n in ("a", "b"))
    assert len({a[0], b[0], base[0]}) == 3 and all(x != y for x, y in zip(a, b))
