"""The packed matmul's blocking per CPU (cpu_kernels/cpu_tuning.py): Intel keeps the constants (no flags, the same
object code), another vendor's CPU gets blocks from its caches, and any blocking gives the very same bits."""

from __future__ import annotations

import functools

import pytest
import torch

from steploop.common import envs
from steploop.gpu_worker.cpu_kernels import build, cpu_tuning
from steploop.gpu_worker.cpu_kernels import packed_linear as kernel
from steploop.gpu_worker.cpu_kernels.packed_weights import pack, pack_w16
from tests.worker.c_kernels import needs_c_kernels
from tests.worker.test_half_weights import random_weight
from tests.worker.test_packed_linear import gguf_q4_1, gguf_q8_0, same_bits

ZEN3 = {"L1d": 32 << 10, "L2": 512 << 10}
ZEN4 = {"L1d": 32 << 10, "L2": 1 << 20}


def test_vendor_and_caches_are_read_from_the_system(tmp_path):
    assert cpu_tuning.vendor("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n") == "AuthenticAMD"
    assert cpu_tuning.vendor("processor\t: 0\nFeatures\t: fp asimd\n") == ""          # arm: none
    for index, (level, kind, size) in enumerate([("1", "Data", "32K"), ("1", "Instruction", "32K"),
                                                 ("2", "Unified", "1024K"), ("3", "Unified", "32768K")]):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        for name, text in (("level", level), ("type", kind), ("size", size)):
            (folder / name).write_text(text + "\n")
    assert cpu_tuning.cache_sizes(tmp_path) == ZEN4
    assert cpu_tuning.cache_sizes(tmp_path / "absent") == {}


def test_intel_keeps_the_constants_and_amd_reads_its_caches():
    env = {}
    assert cpu_tuning.tile_flags("avx512", "GenuineIntel", ZEN3, env) == []
    assert cpu_tuning.tile_flags("avx512", "", ZEN3, env) == []                       # vendor unknown
    # Zen 3 / Zen 4: a 16 KiB tile (half the L1d), x passes of 512 KiB: the constants' values
    assert cpu_tuning.tile_flags("avx2", "AuthenticAMD", ZEN3, env) == ["-DKC=256", "-DX_BYTES=524288"]
    assert cpu_tuning.tile_flags("avx512", "AuthenticAMD", ZEN4, env) == ["-DKC=128", "-DX_BYTES=524288",
                                                                          "-DREGISTER_MAX_M=4"]
    # smaller caches: smaller blocks, k chunks still whole quantization blocks
    assert cpu_tuning.tile_flags("avx512", "AuthenticAMD", {"L1d": 16 << 10, "L2": 256 << 10}, env) == \
        ["-DKC=64", "-DX_BYTES=262144", "-DREGISTER_MAX_M=4"]
    assert cpu_tuning.tile_flags("avx512", "AuthenticAMD", {"L1d": 1 << 10, "L2": 4 << 10}, env)[0] == "-DKC=32"
    assert cpu_tuning.tile_flags("avx2", "AuthenticAMD", {"L1d": 32 << 10}, env) == []    # no L2 read: constants


def test_the_rule_can_be_chosen_and_is_checked():
    assert cpu_tuning.tile_flags("avx2", "AuthenticAMD", ZEN3, {envs.CPU_TUNING: "constants"}) == []
    assert cpu_tuning.tile_flags("avx2", "GenuineIntel", ZEN3, {envs.CPU_TUNING: "caches"}) == \
        ["-DKC=256", "-DX_BYTES=524288"]
    with pytest.raises(ValueError, match="one of vendor, constants, caches"):
        cpu_tuning.rule({envs.CPU_TUNING: "fast"})


@pytest.fixture
def fresh_library():
    """The front end's cached libraries dropped before and after, so a test can build under another blocking."""
    def clear():
        build.load.cache_clear()
        kernel._kernel.cache_clear()
        kernel._w16_kernel.cache_clear()
    clear()
    yield
    clear()


@needs_c_kernels(build.runnable_isas())
@pytest.mark.parametrize("isa", [isa for isa in build.runnable_isas() if isa != "generic"])
@pytest.mark.parametrize("make", [gguf_q4_1, gguf_q8_0, functools.partial(random_weight, torch.bfloat16)],
                         ids=["q4_1", "q8_0", "bf16"])
def test_small_blocks_give_the_constants_bits(make, isa, monkeypatch, fresh_library):
    """A CPU with tiny caches (32-k chunks, x passes of 8 KiB: many chunks and passes) computes every output as the
    same fma chain in k order as the constants' blocking: the same bits, whatever the batch. On AVX-512 that build
    also runs 3 and 4 rows in registers (the constants' build: in the scratch tile), the same bits again."""
    w = make(48, 320, seed=21)
    packed = pack_w16(w) if w.dtype == torch.bfloat16 else pack(w)
    x = torch.randn(70, 320, generator=torch.Generator().manual_seed(22))
    monkeypatch.setenv(envs.CPU_TUNING, "constants")
    wanted = {m: kernel.packed_linear(x[:m], packed, 2, isa=isa) for m in (1, 2, 3, 4, 9, 33, 70)}
    build.load.cache_clear()
    kernel._kernel.cache_clear()
    kernel._w16_kernel.cache_clear()
    monkeypatch.setenv(envs.CPU_TUNING, "caches")
    monkeypatch.setattr(cpu_tuning, "cache_sizes", lambda: {"L1d": 4 << 10, "L2": 8 << 10})
    assert build.build(isa, strict=True) is not None
    for m, y in wanted.items():
        assert same_bits(kernel.packed_linear(x[:m], packed, 2, isa=isa), y), m
