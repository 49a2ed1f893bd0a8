"""Every kernel compiles ahead of time for sm_80 and sm_90 in the configurations the launchers pick, so code
only a real compiler rejects (tl.dot shapes, dtype mixes, constexpr misuse) fails here, without a GPU.

Runs in subprocesses: this pytest process has TRITON_INTERPRET=1 (kernels decorated as interpreted functions
cannot be compiled), and the two architectures compile in parallel. Triton caches results (~/.triton/cache),
so only the first run pays the ~30 s per architecture.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_compiles_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    procs = {arch: subprocess.Popen([sys.executable, "-m", "tests.kernels.aot_compile", str(arch)], cwd=ROOT,
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for arch in (80, 90)}
    outputs = {arch: p.communicate(timeout=600)[0] for arch, p in procs.items()}
    failed = {arch: out for arch, out in outputs.items() if procs[arch].returncode}
    assert not failed, "\n".join(failed.values())
