"""The quantized-GEMM kernels compile ahead of time for sm_80 and sm_90 in every configuration their launchers
pick (tests/kernels/quant_aot_configs.py), without a GPU."""

from __future__ import annotations

from tests.kernels.aot_compile import compile_in_subprocesses


def test_quant_kernels_compile_for_sm80_and_sm90():
    failed = compile_in_subprocesses("tests.kernels.quant_aot_configs")
    assert not failed, "\n".join(failed.values())
