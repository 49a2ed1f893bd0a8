"""The one prepared GPU check (< 5 minutes on one H100/H200):  bash benchmarks/gpu_check.sh

Sections, each guarded by a time limit, each written to the JSON report as soon as it finishes:
    tests      tests/kernels compiled on CUDA (no interpreter), in a subprocess under `timeout`
    copy       the device's copy bandwidth: torch copy of a 1 GiB tensor, (read + write bytes) / time
    attention  decode attention (Llama-3-8B shapes: 32/8 heads, head 128, block 16) at batch x context
               64 x 2k and a few others, fp16/bf16: K/V bytes read / kernel time, as a fraction of the copy
               bandwidth; vs torch SDPA over K/V gathered from the same paged cache (gather + SDPA, and SDPA
               alone); max difference between the two
    e2e        output tokens/s of the default model (bf16), 64 requests x 128 prompt x 128 output tokens,
               through ModelRunner: torch backend, triton backend, triton backend + CUDA graphs
Installs nothing; reads the default model from the local cache (converting it from the installed wheel if
needed). `--dry-run` (CPU-safe, used by tests) runs no section and only writes the report skeleton.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
SECTIONS = ("tests", "copy", "attention", "e2e")
DECODE_CASES = [(64, 2048), (1, 8192), (8, 4096), (128, 1024), (256, 512)]   # (batch, context)


class Report:
    """A JSON file rewritten atomically after every section, so a run killed by a timeout leaves what it had."""

    def __init__(self, path: pathlib.Path, meta: dict):
        self.path, self.data = path, {"meta": meta, "sections": {}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write()

    def put(self, section: str, value) -> None:
        self.data["sections"][section] = value
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(tmp, self.path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results" / "gpu_check.json")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    p.add_argument("--tests-timeout", type=int, default=150, help="seconds for tests/kernels")
    p.add_argument("--e2e-requests", type=int, default=64)
    p.add_argument("--e2e-tokens", type=int, default=128, help="prompt and output tokens per request")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per attention case")
    p.add_argument("--dry-run", action="store_true", help="write the report skeleton only (no GPU needed)")
    args = p.parse_args(argv)
    bad = set(args.sections.split(",")) - set(SECTIONS)
    if bad:
        p.error(f"unknown sections {sorted(bad)}; choose from {', '.join(SECTIONS)}")
    args.sections = [s for s in SECTIONS if s in args.sections.split(",")]
    return args


def meta() -> dict:
    out = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "python": platform.python_version(), "host": platform.node()}
    try:
        import torch
        import triton
        out.update(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                   device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    except Exception as exc:  # noqa: BLE001
        out["import_error"] = repr(exc)
    return out


def run_tests(args) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    start = time.perf_counter()
    cmd = ["timeout", str(args.tests_timeout), sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "tests/kernels", "--deselect", "tests/kernels/test_compile.py"]   # AOT compiling is the CPU CI's job
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    return {"returncode": proc.returncode, "timed_out": proc.returncode == 124,
            "seconds": round(time.perf_counter() - start, 1), "tail": (proc.stdout + proc.stderr)[-3000:]}


def cuda_time(fn, iters: int) -> float:
    """Median seconds of fn() over iters runs, timed with CUDA events after 3 warm-up runs."""
    import torch
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(args) -> dict:
    import torch
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = cuda_time(lambda: dst.copy_(src), args.iters)
    return {"bytes": 2 * src.numel(), "seconds": seconds, "gb_per_s": 2 * src.numel() / seconds / 1e9}


def attention_case(batch: int, ctx: int, dtype, iters: int, copy_gbs: float | None) -> dict:
    import numpy as np
    import torch
    import torch.nn.functional as F

    from services.gpu_worker.kernels.paged_attention import plan_attention, unified_attention

    h, hk, d, bs = 32, 8, 128, 16
    nb = ctx // bs
    cache = torch.randn((2, batch * nb + 1, bs, hk, d), dtype=dtype, device="cuda")
    tables = (torch.randperm(batch * nb, device="cuda") + 1).view(batch, nb).to(torch.int32)
    q = torch.randn((batch, h, d), dtype=dtype, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    seq = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    plan = plan_attention(qsl, seq, tables, np.ones(batch, np.int32), np.full(batch, ctx, np.int32), h, hk)
    out = torch.empty_like(q)
    t_kernel = cuda_time(lambda: unified_attention(q, cache, out, plan, d ** -0.5), iters)
    kv_bytes = 2 * batch * ctx * hk * d * cache.element_size()

    def gathered():
        kv = cache[:, tables.long()].view(2, batch, ctx, hk, d).transpose(2, 3)   # [2, B, Hk, ctx, D]
        return kv

    kv = gathered()
    qs = q.unsqueeze(2)                                                                 # [B, H, 1, D]
    sdpa = lambda: F.scaled_dot_product_attention(qs, kv[0], kv[1], scale=d ** -0.5, enable_gqa=True)
    t_sdpa = cuda_time(sdpa, iters)
    t_both = cuda_time(lambda: F.scaled_dot_product_attention(qs, *gathered().unbind(0), scale=d ** -0.5,
                                                              enable_gqa=True), iters)
    diff = (sdpa().squeeze(2).float() - out.float()).abs().max().item()
    gbs = kv_bytes / t_kernel / 1e9
    return {"batch": batch, "context": ctx, "dtype": str(dtype).removeprefix("torch."), "num_splits": plan.num_splits,
            "kv_bytes": kv_bytes, "kernel_s": t_kernel, "kernel_gb_per_s": gbs,
            "fraction_of_copy_bw": gbs / copy_gbs if copy_gbs else None, "sdpa_s": t_sdpa,
            "gather_plus_sdpa_s": t_both, "speedup_vs_gather_sdpa": t_both / t_kernel, "max_abs_diff": diff}


def attention(args, report: Report) -> list:
    import torch
    copy_gbs = (report.data["sections"].get("copy") or {}).get("gb_per_s")
    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        for batch, ctx in DECODE_CASES:
            try:
                rows.append(attention_case(batch, ctx, dtype, args.iters, copy_gbs))
            except Exception as exc:  # noqa: BLE001 - one failing case does not hide the others
                rows.append({"batch": batch, "context": ctx, "dtype": str(dtype), "error": repr(exc)})
            report.put("attention", rows)
            torch.cuda.empty_cache()
    return rows


def e2e_one(model_dir, backend: str, graphs: bool, args) -> dict:
    import random

    import torch

    from services.gpu_worker.config import WorkerConfig
    from services.gpu_worker.model_runner import ModelRunner
    from tests.worker.driver import Driver

    n, tokens = args.e2e_requests, args.e2e_tokens
    config = WorkerConfig(model=str(model_dir), device="cuda", dtype="bfloat16", attention_backend=backend,
                          cuda_graphs=graphs, num_kv_blocks=n * (2 * tokens // 16 + 2) + 16, max_model_len=1024)
    start = time.perf_counter()
    runner = ModelRunner.from_config(config, model_dir)
    setup = time.perf_counter() - start
    rng = random.Random(0)

    def run_once(max_tokens: int) -> tuple[float, int]:
        runner.reset()
        driver = Driver(runner)
        for i in range(n):
            driver.add(i, [rng.randrange(100, 40000) for _ in range(tokens)], max_tokens)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outputs = driver.run(chunk=tokens, max_steps=10 * max_tokens)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, sum(len(o) for o in outputs.values())

    run_once(4)                                       # warm-up: kernels compiled, allocator primed
    seconds, out_tokens = run_once(tokens)
    result = {"backend": backend, "cuda_graphs": graphs and runner.graphs is not None, "setup_s": setup,
              "seconds": seconds, "output_tokens": out_tokens, "output_tok_per_s": out_tokens / seconds}
    runner.graphs = runner.model = runner.kv_caches = None   # free the GPU memory for the next config
    torch.cuda.empty_cache()
    return result


def e2e(args, report: Report) -> list:
    from services.common.model_path import default_model_dir, is_model_dir

    model_dir = default_model_dir()
    if not is_model_dir(model_dir):
        from services.gpu_worker.gguf_convert import convert_default_model
        convert_default_model(model_dir)
    rows = []
    for backend, graphs in (("torch", False), ("triton", False), ("triton", True)):
        try:
            rows.append(e2e_one(model_dir, backend, graphs, args))
        except Exception as exc:  # noqa: BLE001
            rows.append({"backend": backend, "cuda_graphs": graphs, "error": repr(exc),
                         "traceback": traceback.format_exc()[-2000:]})
        report.put("e2e", rows)
    rows.append({"note": "the torch backend plans on the host every step, so it runs without CUDA graphs"})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = Report(args.out, meta() | {"sections_requested": args.sections, "dry_run": args.dry_run})
    if args.dry_run:
        return 0
    import torch
    if not torch.cuda.is_available():
        report.put("error", "no CUDA device")
        return 2
    steps = {"tests": lambda: run_tests(args), "copy": lambda: copy_bandwidth(args),
             "attention": lambda: attention(args, report), "e2e": lambda: e2e(args, report)}
    for name in args.sections:
        start = time.perf_counter()
        try:
            value = steps[name]()
        except Exception as exc:  # noqa: BLE001
            value = {"error": repr(exc), "traceback": traceback.format_exc()[-2000:]}
        report.put(name, value)
        report.put(f"{name}_seconds", round(time.perf_counter() - start, 1))
        print(f"[gpu_check] {name}: {time.perf_counter() - start:.1f} s", flush=True)
    print(f"[gpu_check] report: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
