"""Every kernel compiles ahead of time for sm_80 and sm_90 in the configurations the launchers pick, so code
only a real compiler rejects (tl.dot shapes, dtype mixes, constexpr misuse) fails here, without a GPU.

Runs in subprocesses: this pytest process has TRITON_INTERPRET=1 (kernels decorated as interpreted functions
cannot be compiled), and the two architectures compile in parallel. Triton caches results (~/.triton/cache),
so only the first run pays the ~30 s per architecture.
"""

from __future__ import annotations

from tests.kernels.aot_compile import compile_in_subprocesses


def test_compiles_for_sm80_and_sm90():
    failed = compile_in_subprocesses("tests.kernels.aot_compile")
    assert not failed, "\n".join(failed.values())
