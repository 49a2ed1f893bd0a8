"""ctypes front end of packed_linear.c: y = x @ W.T in fp32 with W read from its packed form (packed_weights.py's kinds).

    if available():                       # builds/loads the library on first call
        y = packed_linear(x, packed, num_threads)      # packed: packed_weights.pack(weight)
        y = packed_linear(x, packed, num_threads, isa="avx2")     # the AVX2 build's kernel (same bits)
"""

from __future__ import annotations

import ctypes
import functools

import torch

from steploop.gpu_worker.cpu_kernels.build import function, selected_isa
from steploop.gpu_worker.cpu_kernels.packed_weights import (F16, Q4_K, Q5_K, Q6_K, Q8B_BLOCK, SPLIT, W16_DTYPES,
                                                               PackedWeight)

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _default_isa() -> str:
    """The build that calls without an `isa` use, fixed at first use, so the int8 switch and every kernel of this
    module reach the same library (each build is its own shared object, with its own switch)."""
    return selected_isa()


@functools.cache
def _kernel(isa: str | None = None):
    return function("steploop_packed_linear", [_PTR] * 5 + [_I64] * 3 + [ctypes.c_int, ctypes.c_int], isa=isa)


@functools.cache
def _q8b_kernel(isa: str | None = None):
    return function("steploop_packed_linear_q8b", [_PTR] * 5 + [_I64] * 3 + [ctypes.c_int, ctypes.c_int], isa=isa)


@functools.cache
def _q4k_kernel(isa: str | None = None):
    return function("steploop_packed_linear_q4k", [_PTR] * 5 + [_I64] * 3 + [ctypes.c_int], isa=isa)


@functools.cache
def _kquant_kernel(isa: str | None = None):
    return function("steploop_packed_linear_kquant", [_PTR] * 5 + [_I64] * 3 + [ctypes.c_int, ctypes.c_int], isa=isa)


@functools.cache
def _w16_kernel(isa: str | None = None):
    return function("steploop_packed_linear_w16", [_PTR] * 3 + [_I64] * 3 + [ctypes.c_int, ctypes.c_int], isa=isa)


@functools.cache
def _int8_switch(isa: str | None = None):
    return function("steploop_set_int8_activations", [ctypes.c_int], restype=None, isa=isa)


def set_int8_activations(on: bool, isa: str | None = None) -> None:
    """Q4_K and Q6_K weights multiply int8-rounded activations from now on (int8_activations.c: llama.cpp's
    arithmetic, faster on the CPU and NOT exact), or the exact fp32 kernels again; for the whole library."""
    switch = _int8_switch(isa or _default_isa())
    if switch is None:
        raise RuntimeError("the packed linear library is not available (see build.py's warning)")
    switch(int(on))


def available(isa: str | None = None) -> bool:
    return _kernel(isa or _default_isa()) is not None


def packed_linear(x: torch.Tensor, packed: PackedWeight, num_threads: int,
                  out: torch.Tensor | None = None, isa: str | None = None) -> torch.Tensor:
    """x [..., K] fp32 on the CPU -> [..., N] fp32; `isa` picks another build's kernel (build.py; tests, benchmarks)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.shape[-1] != packed.in_features:
        raise ValueError(f"packed_linear: expected fp32 CPU input [..., {packed.in_features}], got "
                         f"{tuple(x.shape)} {x.dtype} on {x.device}")
    isa = isa or _default_isa()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, packed.in_features).contiguous()
    y = out if out is not None else torch.empty(x2.shape[0], packed.out_features, dtype=torch.float32)
    if y.shape != (x2.shape[0], packed.out_features) or y.dtype != torch.float32 or not y.is_contiguous():
        raise ValueError(f"packed_linear: out must be a contiguous fp32 [{x2.shape[0]}, {packed.out_features}]")
    if packed.kind == SPLIT:           # each run of rows by its own form's kernel, into its columns
        col = 0
        for part in packed.parts:
            cols = y[:, col:col + part.out_features]
            if cols.is_contiguous():     # one row: the part's columns are a contiguous run of y
                packed_linear(x2, part, num_threads, out=cols, isa=isa)
            else:
                cols.copy_(packed_linear(x2, part, num_threads, isa=isa))
            col += part.out_features
        return y.view(*lead, packed.out_features)
    if packed.kind in W16_DTYPES:     # a 16-bit checkpoint's weights, widened exactly
        kernel = _w16_kernel(isa)
        if kernel is None:
            raise RuntimeError("the packed linear library is not available (see build.py's warning)")
        if kernel(y.data_ptr(), x2.data_ptr(), packed.qs.data_ptr(), x2.shape[0], packed.out_features,
                  packed.in_features, int(packed.kind == F16), num_threads):
            raise RuntimeError("packed_linear: bad sizes or out of memory")
        return y.view(*lead, packed.out_features)
    q8b = packed.kind in Q8B_BLOCK
    kquant = packed.kind in (Q5_K, Q6_K)
    kernel = (_q4k_kernel(isa) if packed.kind == Q4_K else _kquant_kernel(isa) if kquant else
              _q8b_kernel(isa) if q8b else _kernel(isa))
    if kernel is None:
        raise RuntimeError("the packed linear library is not available (see build.py's warning)")
    if kquant:              # GGUF Q5_K / Q6_K at their width
        rc = kernel(y.data_ptr(), x2.data_ptr(), packed.qs.data_ptr(), packed.d.data_ptr(), packed.m.data_ptr(),
                    x2.shape[0], packed.out_features, packed.in_features, int(packed.kind == Q6_K), num_threads)
    elif packed.kind == Q4_K:          # GGUF Q4_K at its width
        rc = kernel(y.data_ptr(), x2.data_ptr(), packed.qs.data_ptr(), packed.d.data_ptr(), packed.m.data_ptr(),
                    x2.shape[0], packed.out_features, packed.in_features, num_threads)
    elif q8b:              # int8 blocks of 16 / 32 with an optional m (GGUF Q5_1, Q5_K, Q6_K)
        m = packed.m.data_ptr() if packed.m is not None else None
        rc = kernel(y.data_ptr(), x2.data_ptr(), packed.qs.data_ptr(), packed.d.data_ptr(), m, x2.shape[0],
                    packed.out_features, packed.in_features, Q8B_BLOCK[packed.kind], num_threads)
    else:
        rc = kernel(y.data_ptr(), x2.data_ptr(), packed.qs.data_ptr(), packed.d.data_ptr(),
                    packed.m_or_d.data_ptr(), x2.shape[0], packed.out_features, packed.in_features, packed.kind,
                    num_threads)
    if rc:
        raise RuntimeError("packed_linear: bad sizes or out of memory")
    return y.view(*lead, packed.out_features)
