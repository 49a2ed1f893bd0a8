"""gpu_readiness section `preflight`: versions, the device, copy bandwidth and the bf16 GEMM rate."""

from __future__ import annotations

import importlib
import platform
import time

import torch

PACKAGES = ("torch", "triton", "transformers", "safetensors", "numpy", "grpc", "google.protobuf", "aiohttp")


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - a missing package is a finding, not a crash
            out[name] = f"missing: {exc!r}"
    out["cuda"] = torch.version.cuda
    return out


def timed(fn, iters: int, device: str) -> float:
    """Median seconds of fn() after 2 warm-ups."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: str, nbytes: int) -> dict:
    """H2D / D2H from pinned host memory (bytes moved / s), D2D counted as read + write."""
    pin = device == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev2 = torch.empty_like(dev)
    h2d = timed(lambda: dev.copy_(host, non_blocking=True), 5, device)
    d2h = timed(lambda: host.copy_(dev, non_blocking=True), 5, device)
    d2d = timed(lambda: dev2.copy_(dev), 10, device)
    return {"bytes": nbytes, "h2d_gb_per_s": round(nbytes / h2d / 1e9, 1), "d2h_gb_per_s": round(nbytes / d2h / 1e9, 1),
            "d2d_gb_per_s": round(2 * nbytes / d2d / 1e9, 1)}


def gemm_rate(device: str, n: int, dtype: torch.dtype) -> dict:
    a = torch.randn((n, n), device=device).to(dtype)
    b = torch.randn((n, n), device=device).to(dtype)
    seconds = timed(lambda: a @ b, 10, device)
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "tflop_per_s": round(2 * n ** 3 / seconds / 1e12, 1)}


def preflight(dry: bool) -> dict:
    device = "cpu" if dry else "cuda"
    out: dict = {"versions": versions(), "cuda_available": torch.cuda.is_available()}
    if not dry:
        if not torch.cuda.is_available():
            return {**out, "ok": False, "error": "no CUDA device"}
        props = torch.cuda.get_device_properties(0)
        out["device"] = {"name": props.name, "total_gib": round(props.total_memory / 2**30, 1),
                         "sms": props.multi_processor_count, "capability": f"{props.major}.{props.minor}"}
    out["copy"] = copy_bandwidth(device, 1 << (20 if dry else 30))
    out["gemm"] = gemm_rate(device, 256 if dry else 8192, torch.float32 if dry else torch.bfloat16)
    out["ok"] = True
    return out
