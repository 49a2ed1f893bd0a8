"""Kernel tests: compiled on a CUDA device, interpreted (TRITON_INTERPRET=1, CPU tensors) everywhere else.

Why the variable is set here, at conftest import: triton decides interpreted-vs-compiled when @triton.jit
decorates a function, i.e. when a kernel module is first imported, so it must be in the environment before
that. pytest runs the whole suite in one process, so this setting stays for the rest of the run (and for
subprocesses started later). That is acceptable because nothing outside tests/kernels runs a triton kernel:
the worker imports steploop.gpu_worker.kernels only for the triton attention backend, which `auto` never
picks on a CPU, and for the LoRA dispatch (lora_ops), which imports its triton modules only for CUDA tensors;
gateway/scheduler never import triton at all. The guard below fails loudly if a kernel
module was imported (compiled mode) before this conftest, which would make every test here fail on a CPU.
On a CUDA machine nothing is set and the same tests run compiled.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    # only modules that decorate kernels count: lora_ops / lora_meta (the CPU LoRA path) never import triton
    _early = [m for m, mod in list(sys.modules.items())
              if m.startswith("steploop.gpu_worker.kernels.") and "triton" in vars(mod)]
    if _early and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{_early} were imported before tests/kernels/conftest.py set TRITON_INTERPRET=1; "
                           "run tests/kernels in its own pytest process")
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = DEVICE.type == "cpu"

# per-dtype tolerances (atol, rtol) against the fp32 references
TOL = {torch.float32: (2e-5, 1e-4), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}


@pytest.fixture
def device() -> torch.device:
    return DEVICE


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol * scale, rtol=rtol * scale)
