"""Images in (Qwen2.5-VL), the real Scheduler + ModelRunner in one process on the CPU, a random tiny model built
from transformers' config class (tests/vlm/vlm_models.py; no download):

    python -m benchmarks.vlm_images [--rounds 4] [--out benchmarks/results/vlm_images.json]

1. TTFT of a request whose image an earlier request already sent (prefix-cache hit over the image's blocks, so no
   encoder run) vs one with a new image, same prompt shape; alternating new/same/same/new (ABBA) per round;
2. decode inter-token latency (median, p99) of running text streams while image requests arrive, vs the same
   streams alone (issue 35 asks p99 / median <= 1.5x).

Timings on a shared CPU are noisy: each scenario runs one discarded warm-up round, then alternates its modes and
reports the median per mode.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time

import torch

from benchmarks.machine import git_commit, machine_info
from steploop.common.sampling_params import SamplingParams
from steploop.scheduler.async_scheduler import make_scheduler
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.kv_cache_manager import KVCacheManager
from steploop.scheduler.request import Request
from tests.vlm.vlm_models import build_qwen2_5_vl, png_bytes, prompt_with_images

BLOCK = 16
NUM_BLOCKS = 512


def build_runner(model_dir):
    from steploop.gpu_worker.config import WorkerConfig
    from steploop.gpu_worker.model_runner import ModelRunner
    config = WorkerConfig(model=str(model_dir), num_kv_blocks=NUM_BLOCKS, max_model_len=1024, device="cpu",
                          block_size=BLOCK)
    return ModelRunner.from_config(config, model_dir)


def scheduler(runner, max_num_batched_tokens: int, max_decode_slowdown: float = 2.0):
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=16,
                             enable_prefix_caching=True, max_decode_slowdown=max_decode_slowdown)
    info = runner.info
    kv = KVCacheManager(info.num_kv_blocks, BLOCK, True)
    runner.reset()
    return make_scheduler(config, kv, info.max_model_len, list(info.eos_token_ids))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def now() -> tuple[float, float]:
    """(wall, this process's CPU) seconds. With one torch thread the CPU clock is the work done, which the other
    jobs on a shared machine do not stretch; the wall clock is what a client sees."""
    return time.perf_counter(), time.process_time()


def since(start: tuple[float, float], end: tuple[float, float]) -> tuple[float, float]:
    return end[0] - start[0], end[1] - start[1]


def step(runner, sched) -> tuple[tuple[float, float], list]:
    plan = sched.schedule()
    result = runner.execute(plan)
    assert not result.error, result.error
    return now(), sched.update_from_output(plan, result)


def ttft(runner, sched, request: Request) -> tuple[float, float]:
    start = now()
    sched.add_request(request)
    first = None
    while sched.has_unfinished_requests():
        at, outputs = step(runner, sched)
        if first is None and any(o.new_token_ids for o in outputs):
            first = since(start, at)
    return first


def image_request(rid: str, png: bytes, suffix_seed: int, max_tokens: int = 2) -> Request:
    ids, features = prompt_with_images([png], [24, 12], seed=0)        # the same text before the image
    tail, _ = prompt_with_images([], [12], seed=suffix_seed)           # a different question after it
    return Request(rid, ids + tail, sampling=greedy(max_tokens), mm_features=features)


def ttft_same_vs_new(runner, rounds: int, size: int) -> dict:
    """Per trial: a first request with image A, then the measured one with A again ('same') or a new B ('new')."""
    sched = scheduler(runner, 1024)
    times: dict[str, list[tuple[float, float]]] = {"same": [], "new": []}
    seed = 100
    for _ in range(rounds):
        for mode in ("new", "same", "same", "new"):
            seed += 2
            first = png_bytes(size, size, seed)
            ttft(runner, sched, image_request(f"w{seed}", first, seed))
            second = first if mode == "same" else png_bytes(size, size, seed + 1)
            times[mode].append(ttft(runner, sched, image_request(f"m{seed}", second, seed + 1)))
    counts = sched.counters()
    out = {"image_px": size, "image_tokens": image_request("x", png_bytes(size, size, 0), 0).mm_features[0].length,
           "prefix_hit_tokens": counts.prefix_hits, "images_encoded": counts.images_encoded}
    for i, clock in enumerate(CLOCKS):
        same = statistics.median(t[i] for t in times["same"])
        new = statistics.median(t[i] for t in times["new"])
        out[clock] = {"median_ttft_same_s": same, "median_ttft_new_s": new, "new_over_same": new / same,
                      "ttft_s": {mode: [t[i] for t in ts] for mode, ts in times.items()}}
    return out


CLOCKS = ("wall", "cpu")


def itl_with_images(runner, with_images: bool, streams: int, tokens: int, every: int, size: int,
                    budget: int, slowdown: float = 2.0) -> list[tuple[float, float]]:
    """(wall, cpu) inter-token gaps of `streams` text requests decoding `tokens` each; with_images: an image
    request (new image) arrives every `every` steps."""
    sched = scheduler(runner, budget, slowdown)
    for i in range(streams):
        ids, _ = prompt_with_images([], [32], seed=1000 + i)
        sched.add_request(Request(f"t{i}", ids, sampling=greedy(tokens)))
    last: dict[str, tuple[float, float]] = {}
    gaps: list[tuple[float, float]] = []
    n = 0
    while any(f"t{i}" in sched.requests for i in range(streams)):
        if with_images and n % every == 0:
            sched.add_request(image_request(f"img{n}", png_bytes(size, size, 5000 + n), n, max_tokens=4))
        n += 1
        at, outputs = step(runner, sched)
        for o in outputs:
            if o.request_id.startswith("t") and o.new_token_ids:
                if o.request_id in last:
                    gaps.append(since(last[o.request_id], at))
                last[o.request_id] = at
    while sched.has_unfinished_requests():
        step(runner, sched)
    return gaps


def p(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def itl_scenario(runner, rounds: int, size: int, budget: int, slowdown: float) -> dict:
    gaps: dict[str, list[tuple[float, float]]] = {"alone": [], "with_images": []}
    for _ in range(rounds):
        for mode in ("alone", "with_images", "with_images", "alone"):
            gaps[mode] += itl_with_images(runner, mode == "with_images", streams=4, tokens=48, every=8, size=size,
                                          budget=budget, slowdown=slowdown)
    out = {"max_num_batched_tokens": budget, "max_decode_slowdown": slowdown, "image_px": size}
    for i, clock in enumerate(CLOCKS):
        o = out[clock] = {}
        for mode, gs in gaps.items():
            g = [x[i] for x in gs]
            o[mode] = {"median_itl_s": statistics.median(g), "p99_itl_s": p(g, 0.99), "samples": len(g)}
            o[mode]["p99_over_median"] = o[mode]["p99_itl_s"] / o[mode]["median_itl_s"]
        o["p99_with_over_alone"] = o["with_images"]["p99_itl_s"] / o["alone"]["p99_itl_s"]
        o["median_with_over_alone"] = o["with_images"]["median_itl_s"] / o["alone"]["median_itl_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--image-px", type=int, default=336, help="square images: (px/28)^2 placeholder tokens")
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--max-decode-slowdown", type=float, default=2.0, help="prefill pacing (0 = off)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared few-core machine more threads make timings bimodal)")
    ap.add_argument("--out", default="benchmarks/results/vlm_images.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    info = machine_info()
    with tempfile.TemporaryDirectory() as tmp:
        runner = build_runner(build_qwen2_5_vl(pathlib.Path(tmp)))
        # One discarded round of each first: the early steps of every new shape run several times slower
        # (measured: 130-800 ms TTFTs in the first rounds, 7-14 ms later).
        ttft_same_vs_new(runner, 1, args.image_px)
        itl_scenario(runner, 1, args.image_px, args.max_num_batched_tokens, args.max_decode_slowdown)
        ttft_result = ttft_same_vs_new(runner, args.rounds, args.image_px)
        itl_result = itl_scenario(runner, args.rounds, args.image_px, args.max_num_batched_tokens,
                                 args.max_decode_slowdown)
    result = {"benchmark": "vlm_images", "model": "random tiny Qwen2.5-VL (tests/vlm/vlm_models.py)",
              "machine": info, "commit": git_commit(), "ttft": ttft_result, "itl": itl_result}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2))
    for clock in CLOCKS:
        t, i = ttft_result[clock], itl_result[clock]
        w, a = i["with_images"], i["alone"]
        print(f"[{clock}] TTFT new image / same image: {t['new_over_same']:.2f}x (median "
              f"{t['median_ttft_new_s'] * 1e3:.1f} ms vs {t['median_ttft_same_s'] * 1e3:.1f} ms, "
              f"{ttft_result['image_tokens']} image tokens)")
        print(f"[{clock}] decode ITL p99/median while images arrive: {w['p99_over_median']:.2f}x (alone "
              f"{a['p99_over_median']:.2f}x); p99 with/alone {i['p99_with_over_alone']:.2f}x, median with/alone "
              f"{i['median_with_over_alone']:.2f}x")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
