"""The LoRA shrink and expand compile ahead of time for sm_80 and sm_90 in every configuration their launchers
pick (tests/kernels/lora_aot_configs.py), without a GPU, in subprocesses as test_compile.py does. A test of its
own so each compile test stays inside its time limit on a loaded machine; cached in ~/.triton/cache afterwards."""

from __future__ import annotations

from tests.kernels.aot_compile import compile_in_subprocesses


def test_lora_kernels_compile_for_sm80_and_sm90():
    failed = compile_in_subprocesses("tests.kernels.lora_aot_configs", timeout=900)
    assert not failed, "\n".join(failed.values())
