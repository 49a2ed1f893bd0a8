"""Launch configurations (num_warps, num_stages) of the attention kernel per shape class, tuned at start, and the
warm-up that compiles every kernel variant serving can launch before the worker reports ready.

    classes = tune_attention(backend, kv_cache, block_size, max_model_len)   # times the candidates, sets
                                                                             # backend.launch (plans carry it)
    warm_up_attention(backend, kv_cache, block_size)                         # compiles each (class, splits,
                                                                             # layer variant) once

Shape classes (one model: heads, head size, dtype and block size are fixed, so these are the shapes that differ):

    decode   decode-only steps, one split        tiles of 16 rows; short loops over keys
    split    decode-only steps with split-KV     the same tiles, 2-16 splits: fewer keys per program
    mixed    steps with prompt chunks             64-row tiles; long loops over keys

Each class times its candidates on a representative problem (a decode batch at 2k context, a few long 16k
contexts split, a 512-token chunk among decodes; block ids wrap around the real cache, which is only read) and
keeps the fastest. The result is cached per device, Triton version and model shape in
$STEPLOOP_CACHE_DIR/kernel_tuning.json (default ~/.cache/steploop), so a restart on the same machine skips the timing (Triton's own cache keeps
the compiled kernels). Under the Triton interpreter (CPU tests, the readiness dry run) the same logic runs with
the interpreter's timings, which mean nothing: the point there is that the code runs.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from steploop.gpu_worker.kernels.launch_config import (
    CANDIDATES,
    CLASSES,
    DEFAULT,
    SPLITS,
    LaunchConfig,
    shape_class,
)

__all__ = ["CANDIDATES", "CLASSES", "DEFAULT", "SPLITS", "LaunchConfig", "compiled_variants", "shape_class",
           "tune_attention", "warm_up_attention"]

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Problem:
    """One representative launch: per request its query length and context length."""
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_splits: int


def problems(max_model_len: int, tiny: bool = False) -> dict[str, Problem]:
    """The problem each class is timed on (tiny: a few tokens, for the interpreter)."""
    if tiny:
        return {"decode": Problem((1, 1), (9, 17), 1), "split": Problem((1,), (40,), 2),
                "mixed": Problem((6, 1), (6, 12), 1)}
    ctx = min(2048, max_model_len)
    long = min(16384, max_model_len)
    chunk = min(512, max_model_len)
    return {"decode": Problem((1,) * 64, (ctx,) * 64, 1), "split": Problem((1,) * 4, (long,) * 4, 8),
            "mixed": Problem((chunk,) + (1,) * 32, (chunk,) + (min(1024, max_model_len),) * 32, 1)}


def make_launch(backend, problem: Problem, kv_cache: torch.Tensor, block_size: int, config: LaunchConfig,
                window: int | None = None, softcap: float | None = None,
                q_dtype: torch.dtype | None = None) -> Callable[[], torch.Tensor]:
    """A closure that runs the attention kernel once on `problem` with `config` (block ids wrap around the cache).
    q_dtype: the model's (None: the cache's; an FP8 cache runs with layer 0's scales)."""
    from steploop.gpu_worker.attention.metadata import build_common_metadata
    from steploop.gpu_worker.kernels.paged_attention import plan_attention, unified_attention

    device, num_blocks = kv_cache.device, kv_cache.shape[1]
    q_lens, s_lens = np.array(problem.query_lens, np.int32), np.array(problem.seq_lens, np.int32)
    width = int(-(-s_lens.max() // block_size))
    tables = ((np.arange(len(q_lens) * width).reshape(len(q_lens), width) % (num_blocks - 1)) + 1).astype(np.int32)
    slots = np.full(int(q_lens.sum()), -1, np.int64)
    common = build_common_metadata(q_lens, s_lens, tables, slots, block_size, device)
    plan = plan_attention(common.query_start_loc, common.seq_lens, common.block_tables, q_lens, s_lens,
                          backend.num_heads, backend.num_kv_heads, problem.num_splits, launch=config)
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn((int(q_lens.sum()), backend.num_heads, backend.head_dim), generator=gen, device=device)
    q = q.to(q_dtype or kv_cache.dtype)
    out = torch.empty_like(q)
    scales = backend.scales_for(0, kv_cache)
    return lambda: unified_attention(q, kv_cache, out, plan, backend.scale, window, softcap, scales)


def time_launch(launch: Callable[[], torch.Tensor], reps: int = 5) -> float:
    """Median seconds of `reps` runs after one that compiles (CUDA events on a GPU, the wall clock elsewhere)."""
    launch()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            launch()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t = time.perf_counter()
            launch()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def tune_attention(backend, kv_cache: torch.Tensor, block_size: int, max_model_len: int, tiny: bool = False,
                   cache_path: pathlib.Path | None = None, reps: int = 5, max_candidates: int | None = None,
                   q_dtype: torch.dtype | None = None) -> dict:
    """Pick each class's fastest candidate (or take the cached choice), set backend.launch; returns a report.
    max_candidates: time only the first few of each class (the interpreter's dry run). q_dtype: make_launch's."""
    key = _cache_key(backend, kv_cache, block_size) + (" tiny" if tiny else "")
    if q_dtype is not None and q_dtype != kv_cache.dtype:
        key += f" q {str(q_dtype).removeprefix('torch.')}"
    cache_path = cache_path or default_cache_path()
    cached = _read_cache(cache_path).get(key)
    report: dict = {"key": key, "from_cache": cached is not None, "classes": {}}
    start = time.perf_counter()
    for cls, problem in problems(max_model_len, tiny).items():
        if cached and cls in cached:
            backend.launch[cls] = LaunchConfig(**cached[cls]["config"])
            report["classes"][cls] = cached[cls]
            continue
        times, failed = {}, {}
        for c in CANDIDATES[cls][:max_candidates]:
            try:
                times[c] = time_launch(make_launch(backend, problem, kv_cache, block_size, c, q_dtype=q_dtype), reps)
            except Exception as exc:   # noqa: BLE001 - e.g. out of shared memory on this GPU: not a candidate
                failed[f"w{c.num_warps}s{c.num_stages}"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        if not times:
            raise RuntimeError(f"no launch configuration of the {cls} attention kernel runs here: {failed}")
        best = min(times, key=times.get)
        backend.launch[cls] = best
        report["classes"][cls] = {"config": asdict(best), "ms": {f"w{c.num_warps}s{c.num_stages}": round(t * 1e3, 4)
                                                                 for c, t in times.items()},
                                  **({"failed": failed} if failed else {})}
    report["seconds"] = round(time.perf_counter() - start, 2)
    if not report["from_cache"]:
        _write_cache(cache_path, key, report["classes"])
    log.info("attention launch configs (%s, %.1f s): %s", "cached" if report["from_cache"] else "tuned",
             report["seconds"], ", ".join(f"{c} {v['config']}" for c, v in report["classes"].items()))
    return report


def warm_up_attention(backend, kv_cache: torch.Tensor, block_size: int, q_dtype: torch.dtype | None = None) -> list[str]:
    """Compile every attention variant serving can launch (class x split count x layer variant) on a tiny problem,
    so no compile lands inside a step. Returns the variants run."""
    variants = sorted({(None, None), *backend.variants.values()}, key=str)
    shapes = [("decode", Problem((1,), (3,), 1)), ("mixed", Problem((3,), (3,), 1))]
    shapes += [("split", Problem((1,), (3 * s,), s)) for s in SPLITS]
    done = []
    for cls, problem in shapes:
        for window, softcap in variants:
            make_launch(backend, problem, kv_cache, block_size, backend.launch.get(cls, DEFAULT), window, softcap,
                        q_dtype)()
            done.append(f"{cls}/splits={problem.num_splits}/window={window}/softcap={softcap}")
    if kv_cache.is_cuda:
        torch.cuda.synchronize(kv_cache.device)
    return done


def compiled_variants() -> int | None:
    """How many attention kernel variants Triton has compiled in this process (None under the interpreter), so a
    check can see that serving compiled nothing new after the warm-up."""
    from steploop.gpu_worker.kernels import paged_attention

    total = 0
    for kernel in (paged_attention.unified_attention_kernel, paged_attention.reduce_splits_kernel):
        caches = getattr(kernel, "device_caches", None)
        if caches is None:
            return None
        total += sum(len(entry[0]) for entry in caches.values())
    return total


def default_cache_path() -> pathlib.Path:
    from steploop.common.model_path import cache_dir
    return cache_dir() / "kernel_tuning.json"


def _cache_key(backend, kv_cache: torch.Tensor, block_size: int) -> str:
    import triton

    device = torch.cuda.get_device_name(kv_cache.device) if kv_cache.is_cuda else "cpu"
    return (f"{device}|triton {triton.__version__}|H{backend.num_heads} Hk{backend.num_kv_heads} "
            f"D{backend.head_dim} B{block_size} {str(kv_cache.dtype).removeprefix('torch.')}")


def _read_cache(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(path: pathlib.Path, key: str, classes: dict) -> None:
    try:
        data = _read_cache(path)
        data[key] = classes
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError as exc:       # a read-only home: tune again next start
        log.warning("could not save kernel tuning to %s: %s", path, exc)
