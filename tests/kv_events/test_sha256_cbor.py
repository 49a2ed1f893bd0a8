"""vLLM's sha256_cbor block keys (services/common/block_hashing.py), checked against hashes this test computes
itself with cbor2 + hashlib from vLLM's definition (vllm/v1/core/kv_cache_utils.py hash_block_tokens,
init_none_hash; vllm/utils/hashing.py sha256_cbor; vLLM 0.32.0), and the scheduler's flag that selects it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from steploop.common.block_hashing import block_hashes, get_block_hasher, hasher_root
from steploop.common.sampling_params import SamplingParams
from steploop.scheduler.config import SchedulerConfig, SchedulerConfigError
from steploop.scheduler.kv_cache_manager import KVCacheManager
from steploop.scheduler.request import Request
from tests.integration.cluster import ROOT
from tests.kv_events.helpers import SEED, cbor_sha256, expected_chain

TOKENS = list(range(100, 141))   # 41 tokens: 2 full blocks of 16 and a partial one (no key)


def test_keys_match_vllm_definition():
    hasher = get_block_hasher("sha256_cbor")
    assert block_hashes(TOKENS, 16, None, hasher) == expected_chain(TOKENS, 16)
    assert hasher_root("sha256_cbor") == cbor_sha256(SEED)


def test_without_pythonhashseed_the_seed_is_vllms_fixed_default():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    assert _keys_in_subprocess(env) == "".join(h.hex() for h in expected_chain(TOKENS, 16, seed="vllm-none-hash"))


def test_cache_salt_is_a_tagged_extra_key_of_the_first_block_only():
    hasher = get_block_hasher("sha256_cbor")
    salted = block_hashes(TOKENS, 16, "tenant-a", hasher)
    assert salted == expected_chain(TOKENS, 16, salt="tenant-a")
    assert salted[0] != block_hashes(TOKENS, 16, None, hasher)[0]


def _keys_in_subprocess(env: dict) -> str:
    """NONE_HASH is derived once per process from its environment (as in vLLM), so each seed gets a process."""
    code = ("from steploop.common.block_hashing import block_hashes, get_block_hasher\n"
            "print(''.join(h.hex() for h in block_hashes(list(range(100, 141)), 16, None, "
            "get_block_hasher('sha256_cbor'))))")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_pythonhashseed_is_the_none_hash_seed():
    out = _keys_in_subprocess({**os.environ, "PYTHONHASHSEED": "1234"})
    assert out == "".join(h.hex() for h in expected_chain(TOKENS, 16, seed="1234"))


def test_a_peers_root_overrides_this_process_seed():
    root = cbor_sha256("1234")
    assert block_hashes(TOKENS, 16, None, get_block_hasher("sha256_cbor", root)) == expected_chain(TOKENS, 16, "1234")


def test_the_scheduler_keys_its_prefix_cache_with_the_chosen_function():
    kv = KVCacheManager(16, 16, hasher=get_block_hasher("sha256_cbor"))
    request = Request(request_id="r", prompt_token_ids=TOKENS, sampling=SamplingParams(max_tokens=1))
    assert kv.allocate_slots(request, len(TOKENS)) is not None
    kv.cache_blocks(request, len(TOKENS))
    assert sorted(kv.pool.block_hash.values()) == sorted(expected_chain(TOKENS, 16))


def test_the_flag_refuses_an_unknown_function_with_the_choices():
    with pytest.raises(SchedulerConfigError, match="sha256_cbor"):
        SchedulerConfig(prefix_caching_hash_algo="xxhash")
    assert SchedulerConfig(prefix_caching_hash_algo="sha256_cbor").prefix_caching_hash_algo == "sha256_cbor"
