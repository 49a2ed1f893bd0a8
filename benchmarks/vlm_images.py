"""Images in (Qwen2.5-VL), the real Scheduler + ModelRunner in one process on the CPU, a random model built from
transformers' config class (tests/vlm/vlm_models.py; no download), sized by the flags (default: a 32-layer,
64-wide vision tower beside a 4-layer, 256-wide decoder: a 224 px image (64 tokens) costs ~15 decode steps of 4
streams, a layer ~half of one, as Qwen2.5-VL-7B's 32-layer tower does on compute-bound hardware; --vision-depth 2
--vision-hidden 32 --text-hidden 64 --text-layers 2 is the tests' tiny one):

    python -m benchmarks.vlm_images [--rounds 2] [--out benchmarks/results/vlm_images.json]

1. TTFT of a request whose image an earlier request already sent (prefix-cache hit over the image's blocks, so no
   encoder run) vs one with a new image, same prompt shape; alternating new/same/same/new (ABBA) per round; with
   the image encoded whole and in slices;
2. decode inter-token latency (median, p99) of running text streams while image requests arrive, with each image
   encoded whole in one step ('whole'), with serving's defaults ('default': the encoder budget is
   --max-num-batched-tokens, so the tower is sliced only as far as prefill pacing's allowance asks) or a slice of
   tower layers per step within a small budget ('sliced': --max-num-encoder-input-tokens = --sliced-encoder-budget,
   scheduler/encoder_budget.py), vs the same streams alone, alternating alone/whole/default/sliced and back per
   round (issue 35 asks p99 / median <= 1.5x); each run's scheduler first serves a few text prompts and an image,
   as a serving one has, so prefill pacing's cost model is fitted. The 'wall' clock is the latency a client sees;
   the 'cpu' clock is this process's CPU time, the C kernels' threads included, so it counts work, not waiting.

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


def scheduler(runner, max_num_batched_tokens: int, max_decode_slowdown: float = 2.0, encoder_budget: int = 0,
              slices: bool | None = None):
    """encoder_budget > 0: images are encoded a slice of tower layers per step within it; 0: whole, unless `slices`
    (serving's default: the budget is max_num_batched_tokens and the pacer's allowance plans the slices)."""
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=16,
                             enable_prefix_caching=True, max_decode_slowdown=max_decode_slowdown,
                             max_num_encoder_input_tokens=encoder_budget, encoder_cache_size=4096)
    info = runner.info
    kv = KVCacheManager(info.num_kv_blocks, BLOCK, True)
    runner.reset()
    sched = make_scheduler(config, kv, info.max_model_len, list(info.eos_token_ids))
    slices = bool(encoder_budget) if slices is None else slices
    sched.encoder.depth = info.encoder_layers if slices else 0    # what the worker's hello sets
    return sched


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


def ttft_same_vs_new(runner, rounds: int, size: int, encoder_budget: int = 0) -> dict:
    """Per trial: a first request with image A, then the measured one with A again ('same') or a new B ('new')."""
    sched = scheduler(runner, 1024, encoder_budget=encoder_budget)
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
           "prefix_hit_tokens": counts.prefix_hits, "images_encoded": counts.images_encoded,
           "encoder_budget": encoder_budget, "encoder_slices": sched.encoder.num_slices}
    for i, clock in enumerate(CLOCKS):
        same = statistics.median(t[i] for t in times["same"])
        new = statistics.median(t[i] for t in times["new"])
        out[clock] = {"median_ttft_same_s": same, "median_ttft_new_s": new, "new_over_same": new / same,
                      "ttft_s": {mode: [t[i] for t in ts] for mode, ts in times.items()}}
    return out


CLOCKS = ("wall", "cpu")


def itl_with_images(runner, with_images: bool, streams: int, tokens: int, every: int, size: int,
                    budget: int, slowdown: float = 2.0, encoder_budget: int = 0,
                    slices: bool | None = None) -> list[tuple[float, float]]:
    """(wall, cpu) inter-token gaps of `streams` text requests decoding `tokens` each; with_images: an image
    request (new image) arrives every `every` steps; encoder_budget > 0: encoded in slices within it (slices:
    scheduler()'s)."""
    sched = scheduler(runner, budget, slowdown, encoder_budget, slices)
    warm_up(runner, sched, size)
    # The image requests are built before the clock runs: in serving the gateway decodes and preprocesses an image
    # (~14 ms here) in its own process, not inside the scheduler's step loop, so it is no part of a stream's gap.
    arrivals = [image_request(f"img{n}", png_bytes(size, size, 5000 + n), n, max_tokens=4)
                for n in range(0, 2 * tokens + 8 * every, every)] if with_images else []
    for i in range(streams):
        ids, _ = prompt_with_images([], [32], seed=1000 + i)
        sched.add_request(Request(f"t{i}", ids, sampling=greedy(tokens)))
    last: dict[str, tuple[float, float]] = {}
    gaps: list[tuple[float, float]] = []
    n = 0
    while any(f"t{i}" in sched.requests for i in range(streams)):
        if with_images and n % every == 0 and n // every < len(arrivals):
            sched.add_request(arrivals[n // every])
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


def warm_up(runner, sched, size: int) -> None:
    """What a serving scheduler has seen before these streams: text prompts and an image alone, so prefill pacing's
    cost model is fitted (it caps nothing until it is) and knows the tower's time per image token; then images
    arriving beside two decoding streams, so it knows how far such steps stray from its predictions
    (prediction_spread.py: it paces by that spread only after a few of them)."""
    for i in range(3):
        ids, _ = prompt_with_images([], [40 + 30 * i], seed=900 + i)
        sched.add_request(Request(f"warm{i}", ids, sampling=greedy(8)))
    sched.add_request(image_request("warm-img", png_bytes(size, size, 4999), 4999))
    while sched.has_unfinished_requests():
        step(runner, sched)
    images = [image_request(f"warm-img{i}", png_bytes(size, size, 4000 + i), 4000 + i) for i in range(4)]
    for i in range(2):
        ids, _ = prompt_with_images([], [32], seed=950 + i)
        sched.add_request(Request(f"warm-stream{i}", ids, sampling=greedy(40)))
    n = 0
    while sched.has_unfinished_requests():
        if n % 8 == 4 and n // 8 < len(images):
            sched.add_request(images[n // 8])
        n += 1
        step(runner, sched)


def p(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


# whole: no slices (a tower without a reported depth); default: serving's defaults (--max-num-encoder-input-tokens
# 0, so slices only as the pacer's allowance asks); sliced: --max-num-encoder-input-tokens = --sliced-encoder-budget
ITL_MODES = ("alone", "whole", "default", "sliced", "sliced", "default", "whole", "alone")


def itl_scenario(runner, rounds: int, size: int, budget: int, slowdown: float, sliced_budget: int) -> dict:
    gaps: dict[str, list[tuple[float, float]]] = {"alone": [], "whole": [], "default": [], "sliced": []}
    loads: dict[str, list[float]] = {mode: [] for mode in gaps}
    for _ in range(rounds):
        for mode in ITL_MODES:
            loads[mode].append(load_average())
            gaps[mode] += itl_with_images(runner, mode != "alone", streams=4, tokens=48, every=8, size=size,
                                          budget=budget, slowdown=slowdown,
                                          encoder_budget=sliced_budget if mode == "sliced" else 0,
                                          slices=mode != "whole")
    out = {"max_num_batched_tokens": budget, "max_decode_slowdown": slowdown, "image_px": size,
           "sliced_encoder_budget": sliced_budget,
           "load_average_1m": {mode: statistics.median(v) for mode, v in loads.items()}}
    for i, clock in enumerate(CLOCKS):
        o = out[clock] = {}
        for mode, gs in gaps.items():
            g = [x[i] for x in gs]
            o[mode] = {"median_itl_s": statistics.median(g), "p99_itl_s": p(g, 0.99), "samples": len(g)}
            o[mode]["p99_over_median"] = o[mode]["p99_itl_s"] / o[mode]["median_itl_s"]
        for mode in ("whole", "default", "sliced"):
            o[f"p99_{mode}_over_alone"] = o[mode]["p99_itl_s"] / o["alone"]["p99_itl_s"]
            o[f"median_{mode}_over_alone"] = o[mode]["median_itl_s"] / o["alone"]["median_itl_s"]
    return out


def load_average() -> float:
    return float(pathlib.Path("/proc/loadavg").read_text().split()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--image-px", type=int, default=224, help="square images: (px/28)^2 placeholder tokens")
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--max-decode-slowdown", type=float, default=2.0, help="prefill pacing (0 = off)")
    ap.add_argument("--sliced-encoder-budget", type=int, default=2,
                    help="encoder tokens per step in the sliced mode (a layer of an image of L tokens costs L/depth)")
    ap.add_argument("--vision-depth", type=int, default=32)
    ap.add_argument("--vision-hidden", type=int, default=64)
    ap.add_argument("--text-hidden", type=int, default=256)
    ap.add_argument("--text-layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared few-core machine more threads make timings bimodal)")
    ap.add_argument("--out", default="benchmarks/results/vlm_images.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    info = machine_info()
    size, sliced = args.image_px, args.sliced_encoder_budget
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(pathlib.Path(tmp), args)
        runner = build_runner(model)
        # One discarded round of each first: the early steps of every new shape run several times slower
        # (measured: 130-800 ms TTFTs in the first rounds, 7-14 ms later).
        ttft_same_vs_new(runner, 1, size)
        ttft_same_vs_new(runner, 1, size, sliced)
        itl_scenario(runner, 1, size, args.max_num_batched_tokens, args.max_decode_slowdown, sliced)
        ttft_result = {"whole": ttft_same_vs_new(runner, args.rounds, size),
                       "sliced": ttft_same_vs_new(runner, args.rounds, size, sliced), "load_average_1m": load_average()}
        itl_result = itl_scenario(runner, args.rounds, size, args.max_num_batched_tokens, args.max_decode_slowdown,
                                  sliced)
    result = {"benchmark": "vlm_images", "model": model_description(args), "machine": info,
              "commit": git_commit(), "ttft": ttft_result, "itl": itl_result}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2))
    report(ttft_result, itl_result)
    print(f"wrote {args.out}")


def build_model(folder: pathlib.Path, args) -> pathlib.Path:
    heads = max(args.vision_hidden // 32, 1)
    vision = {"depth": args.vision_depth, "hidden_size": args.vision_hidden, "num_heads": heads,
              "intermediate_size": 4 * args.vision_hidden, "window_size": 112,
              "fullatt_block_indexes": list(range(args.vision_depth // 4 - 1, args.vision_depth, args.vision_depth // 4))
              if args.vision_depth >= 4 else [args.vision_depth - 1]}
    text = {"hidden_size": args.text_hidden, "intermediate_size": 4 * args.text_hidden,
            "num_hidden_layers": args.text_layers, "num_attention_heads": max(args.text_hidden // 32, 2),
            "num_key_value_heads": 2}
    half = args.text_hidden // text["num_attention_heads"] // 2        # rotary half-dims, split as Qwen2.5-VL's
    text["rope_scaling"] = {"type": "mrope", "mrope_section": [half // 4, half * 3 // 8, half - half // 4 - half * 3 // 8]}
    return build_qwen2_5_vl(folder, text=text, vision=vision)


def model_description(args) -> str:
    return (f"random Qwen2.5-VL (tests/vlm/vlm_models.py): vision tower {args.vision_depth} layers x "
            f"{args.vision_hidden}, decoder {args.text_layers} layers x {args.text_hidden}")


def report(ttft_result: dict, itl_result: dict) -> None:
    load = ttft_result["load_average_1m"]
    for mode in ("whole", "sliced"):
        r = ttft_result[mode]
        for clock in CLOCKS:
            t = r[clock]
            print(f"[{clock}] TTFT ({mode} encode) new image / same image: {t['new_over_same']:.2f}x (median "
                  f"{t['median_ttft_new_s'] * 1e3:.1f} ms vs {t['median_ttft_same_s'] * 1e3:.1f} ms, "
                  f"{r['image_tokens']} image tokens; load {load:.1f})")
    loads = itl_result["load_average_1m"]
    for clock in CLOCKS:
        i = itl_result[clock]
        a = i["alone"]
        print(f"[{clock}] decode ITL p99/median alone: {a['p99_over_median']:.2f}x "
              f"(median {a['median_itl_s'] * 1e3:.1f} ms; load {loads['alone']:.1f})")
        for mode in ("whole", "default", "sliced"):
            w = i[mode]
            print(f"[{clock}] decode ITL p99/median while images arrive, {mode}: {w['p99_over_median']:.2f}x "
                  f"(median {w['median_itl_s'] * 1e3:.1f} ms, p99 {w['p99_itl_s'] * 1e3:.1f} ms; p99 vs alone "
                  f"{i[f'p99_{mode}_over_alone']:.2f}x; load {loads[mode]:.1f})")


if __name__ == "__main__":
    main()
