"""KV tiers below the pool, on vs off, alternating in one run (the real Scheduler + ModelRunner in one process, CPU):

    python -m benchmarks.kv_tiers [--rounds 2] [--out benchmarks/results/kv_tiers.json]

1. multi-turn chat, working set ~4x the pool: mean TTFT of the returning turns (their prefix left the pool), and
   tokens per second over the whole chat;
2. preemption-heavy: a pool of ~1.5 full sequences (4 requests of 0.45 pool prompt + 0.2 pool output, all at once):
   total time and p99 TTFT, swap (tiers on: preempted blocks demoted to host and restored) vs recompute (tiers off,
   prefix caching on: the engine's default, which keeps a preempted request's blocks that the pool did not reuse)
   vs amnesia (prefix caching off too: the whole context recomputed), with where the time went;
   preemption_long (`--only preemption_long`): the same at the issue's 2k-4k contexts, 2048 + 768-token
   sequences in a pool of 1.5 of them (--long-pool; its own runner), off/on, with the tokens each resume found in
   the pool, restored or recomputed;
3. no hits at all (unique prompts through a small pool, every eviction still stored below): throughput ratio;
4. disk after a restart: a long prompt's TTFT cold vs restored from the disk files a previous worker left;
   disk_sigkill (`--only disk_sigkill`, kv_tiers_sigkill.py): the same across a real `kill -9` of the worker that
   `steploop serve` runs (its supervisor restarts it), through the Engine gRPC API, disk vs cold alternating.

Timings on a shared CPU are noisy: each scenario alternates off/on (ABBA) and reports the median per mode.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import tempfile
import time

from benchmarks.kv_tiers_sigkill import disk_sigkill
from benchmarks.machine import git_commit, machine_info
from steploop.common.sampling_params import SamplingParams
from steploop.gpu_worker.kv_disk_tier import DiskTier
from steploop.gpu_worker.kv_tier_mover import KvTierMover
from steploop.scheduler.async_scheduler import make_scheduler
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.kv_cache_manager import KVCacheManager
from steploop.scheduler.kv_tiers import KvTiers
from steploop.scheduler.request import Request

BLOCK = 16


def build_runner(model_dir, num_blocks: int, host_gib: float, disk: str):
    from steploop.gpu_worker.config import WorkerConfig
    from steploop.gpu_worker.model_runner import ModelRunner

    config = WorkerConfig(model=str(model_dir), num_kv_blocks=num_blocks, max_model_len=(num_blocks - 1) * BLOCK,
                          device="cpu", block_size=BLOCK, kv_offloading_size=host_gib, kv_disk_path=disk,
                          kv_disk_size=2.0 if disk else 0.0)
    return ModelRunner.from_config(config, model_dir)


def scheduler(runner, tiers: bool, max_num_seqs: int = 8, prefix_caching: bool = True):
    config = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=max_num_seqs,
                             enable_prefix_caching=prefix_caching)
    info = runner.info
    kv = KVCacheManager(info.num_kv_blocks, BLOCK, prefix_caching)
    sched = make_scheduler(config, kv, info.max_model_len, list(info.eos_token_ids))
    if tiers:
        m = runner.tiers
        kv.attach_tiers(KvTiers(m.num_host_blocks, m.disk_blocks, m.block_bytes, m.disk_hashes()))
    runner.reset()
    return sched


def drive(runner, sched, requests: list[Request]) -> tuple[dict[str, float], float, int]:
    """Add all, step to idle: TTFT per request (from its add), wall seconds, tokens computed."""
    start = time.perf_counter()
    for r in requests:
        sched.add_request(r)
    ttft: dict[str, float] = {}
    tokens = 0
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        result = runner.execute(plan)
        assert not result.error, result.error
        tokens += plan.total_num_scheduled_tokens
        now = time.perf_counter()
        for out in sched.update_from_output(plan, result):
            if out.new_token_ids and out.request_id not in ttft:
                ttft[out.request_id] = now - start
    return ttft, time.perf_counter() - start, tokens


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def multi_turn(runner, tiers: bool, convs: int, first: int, added: int, turns: int) -> dict:
    rng = random.Random(1)
    sched = scheduler(runner, tiers)
    history = [rand_tokens(rng, first) for _ in range(convs)]
    returning, t0, outputs = [], time.perf_counter(), 0
    for turn in range(turns):
        for c in range(convs):               # one user at a time: TTFT is the prefill the turn needs
            req = Request(f"c{c}t{turn}", list(history[c]), sampling=greedy(16))
            ttft, _, _ = drive(runner, sched, [req])
            if turn:
                returning.append(ttft[req.request_id])
            history[c] = history[c] + req.output_token_ids + rand_tokens(rng, added)
            outputs += len(req.output_token_ids)
    wall = time.perf_counter() - t0
    return {"mean_returning_ttft_s": statistics.mean(returning), "output_tok_s": outputs / wall, "wall_s": wall,
            "tier_hits_tokens": sched.kv.tiers.stats["CPU"].hits if tiers else 0}


def preemption_heavy(runner, mode: str, n: int, prompt: int | list[int], output: int) -> dict:
    """mode: "on" (swap), "off" (tiers off, prefix caching on), "amnesia" (prefix caching off). Besides the totals:
    prompt tokens computed again after a preemption, and the seconds of decode-only steps vs steps with prompt work;
    per resume of a preempted request: the tokens the pool still held (prefix cache), those restored from host
    memory, and whether it swapped (restored some) or recomputed (restored none)."""
    rng = random.Random(2)
    sched = scheduler(runner, mode == "on", max_num_seqs=n, prefix_caching=mode != "amnesia")
    prompts = prompt if isinstance(prompt, list) else [prompt] * n
    reqs = [Request(f"p{i}", rand_tokens(rng, prompts[i]), sampling=greedy(output)) for i in range(n)]
    load_start = os.getloadavg()[0]
    start = time.perf_counter()
    for r in reqs:
        sched.add_request(r)
    ttft: dict[str, float] = {}
    reached = {r.request_id: 0 for r in reqs}        # the furthest each request's KV ever got
    tokens = recomputed = decode_steps = swaps = recomputes = resumed_pool = resumed_restored = 0
    decode_s = prompt_s = 0.0
    restored: dict[str, int] = {}                    # request id -> tokens its latest admission restored from host
    if mode == "on":
        tiers = sched.kv.tiers
        record = tiers.record_admission

        def record_admission(request_id, num_tokens, num_pool_hit, num_restored, block_size):
            restored[request_id] = num_restored
            record(request_id, num_tokens, num_pool_hit, num_restored, block_size)
        tiers.record_admission = record_admission
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        for new in plan.new_requests:
            r = sched.handles.by_handle[new.handle]
            if r.num_preemptions:                    # a resume
                got = restored.get(r.request_id, 0)
                resumed_restored += got
                resumed_pool += new.num_computed_tokens - got
                swaps, recomputes = swaps + (got > 0), recomputes + (got == 0)
        for handle, k in zip(plan.scheduled_handles, plan.num_scheduled_tokens):
            r = sched.handles.by_handle[handle]
            recomputed += max(0, min(reached[r.request_id], r.num_computed_tokens) - (r.num_computed_tokens - k))
            reached[r.request_id] = max(reached[r.request_id], r.num_computed_tokens)
        t = time.perf_counter()
        result = runner.execute(plan)
        seconds = time.perf_counter() - t
        assert not result.error, result.error
        if max(plan.num_scheduled_tokens, default=0) > 1:
            prompt_s += seconds
        else:
            decode_s, decode_steps = decode_s + seconds, decode_steps + 1
        tokens += plan.total_num_scheduled_tokens
        now = time.perf_counter()
        for out in sched.update_from_output(plan, result):
            if out.new_token_ids and out.request_id not in ttft:
                ttft[out.request_id] = now - start
    wall = time.perf_counter() - start
    ts = sorted(ttft.values())
    return {"total_s": wall, "p99_ttft_s": ts[min(len(ts) - 1, int(0.99 * len(ts)))], "computed_tokens": tokens,
            "recomputed_tokens": recomputed, "preemptions": sched.num_preemptions, "resumes_swapped": swaps,
            "resumes_recomputed": recomputes, "resumed_pool_hit_tokens": resumed_pool,
            "resumed_restored_tokens": resumed_restored,
            "decode_only_steps": decode_steps, "decode_only_s": decode_s, "prompt_steps_s": prompt_s,
            "tier_hits_tokens": sched.kv.tiers.stats["CPU"].hits if mode == "on" else 0,
            "load_1m_start": load_start, "load_1m_end": os.getloadavg()[0]}


def no_hits(runner, tiers: bool, n: int, prompt: int, output: int) -> dict:
    rng = random.Random(3)
    sched = scheduler(runner, tiers, max_num_seqs=4)
    reqs = [Request(f"u{i}", rand_tokens(rng, prompt), sampling=greedy(output)) for i in range(n)]
    _, wall, tokens = drive(runner, sched, reqs)
    return {"tok_s": tokens / wall, "wall_s": wall,
            "blocks_stored": sched.kv.tiers.stats["CPU"].blocks_in if tiers else 0}


def disk_restart(runner, prompt_len: int) -> dict:
    """Cold TTFT of a long prompt, then push it to disk, 'restart' (empty pool and host memory, the same files),
    and its TTFT restored from disk."""
    rng = random.Random(4)
    prompt = rand_tokens(rng, prompt_len)
    cold, _, _ = drive(runner, scheduler(runner, False), [Request("cold", prompt, sampling=greedy(1))])
    old = runner.tiers
    disk = lambda: DiskTier(old.disk.folder.parent, old.disk.fingerprint, old.disk.payload_bytes)
    blocks = prompt_len // BLOCK
    runner.tiers = KvTierMover(runner.kv_caches, blocks * 4 // 5, disk(), old.disk_blocks)   # spills to disk
    sched = scheduler(runner, True)
    drive(runner, sched, [Request("w", prompt, sampling=greedy(1))])
    for i in range(3):                                             # push its blocks out of the pool and host
        drive(runner, sched, [Request(f"f{i}", rand_tokens(rng, prompt_len), sampling=greedy(1))])
    runner.tiers = KvTierMover(runner.kv_caches, old.num_host_blocks, disk(), old.disk_blocks)   # the restart
    sched = scheduler(runner, True)
    warm, _, _ = drive(runner, sched, [Request("disk", prompt, sampling=greedy(1))])
    return {"cold_ttft_s": cold["cold"], "disk_ttft_s": warm["disk"],
            "disk_hits_tokens": sched.kv.tiers.stats["DISK"].hits}


def cpu_flags() -> str:
    """The whole flags line of /proc/cpuinfo (machine_info keeps the SIMD ones only)."""
    lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines() if os.path.exists("/proc/cpuinfo") else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("flags")), "")


def progress(name: str, result: dict) -> None:
    print(name, json.dumps(result), flush=True)


def alternate(fn, rounds: int, modes: tuple[str, ...] = ("off", "on"), flag: bool = True,
              keep_rounds: bool = False) -> dict:
    """Run fn per mode, the order reversed every other round (ABBA); fn gets mode == "on", or the mode itself
    when flag is False. The median per mode; with keep_rounds every run too, under "rounds"."""
    runs = {mode: [] for mode in modes}
    for r in range(rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            runs[mode].append(fn(mode == "on" if flag else mode))
            if keep_rounds:
                progress(f"  round {r} {mode}", runs[mode][-1])
    out = {mode: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for mode, rs in runs.items()}
    if keep_rounds:
        out["rounds"] = runs
    return out


def preemption_long(model_dir, args) -> dict:
    """The issue's preemption-heavy load at its 2k-4k-token contexts: requests of --long-prompt tokens that
    generate --long-output, a pool of --long-pool full sequences (1.5: two run together and, as they grow, one is
    preempted; the other's growth then reuses the preempted request's blocks before it resumes), host memory for 2
    sequences, no disk. Its own runner (pool sized for it); modes alternate ABBA."""
    seq = args.long_prompt + args.long_output
    pool_blocks = int(args.long_pool * seq) // BLOCK + 1         # + the null block
    # No disk tier: every run uses the same prompts, and files a run left would be hits for the next one.
    runner = build_runner(model_dir, pool_blocks, host_gib=0.01, disk="")
    runner.tiers = KvTierMover(runner.kv_caches, 2 * seq // BLOCK)
    result = alternate(lambda mode: preemption_heavy(runner, mode, args.long_requests, args.long_prompt,
                                                     args.long_output),
                       args.rounds, tuple(args.long_modes.split(",")), flag=False, keep_rounds=True)
    result.update(pool_tokens=(pool_blocks - 1) * BLOCK, pool_sequences=args.long_pool,
                  host_blocks=runner.tiers.num_host_blocks,
                  requests=args.long_requests, prompt_tokens=args.long_prompt, output_tokens=args.long_output)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/kv_tiers.json")
    parser.add_argument("--only", default="multi_turn,preemption,no_hits,disk_restart",
                        help="comma-separated scenarios to run")
    parser.add_argument("--pool-tokens", type=int, default=2048, help="the device pool (multi-turn contexts scale "
                        "with it: 0.7x to ~0.95x of it, 5 conversations)")
    parser.add_argument("--long-prompt", type=int, default=2048, help="preemption_long: prompt tokens")
    parser.add_argument("--long-output", type=int, default=768, help="preemption_long: output tokens (a full "
                        "sequence: 2048 + 768 = 2816 tokens, inside the issue's 2k-4k)")
    parser.add_argument("--long-pool", type=float, default=1.5, help="preemption_long: the pool, in full "
                        "sequences (the issue: one or two)")
    parser.add_argument("--long-requests", type=int, default=4, help="preemption_long: requests, all at once")
    parser.add_argument("--sigkill-prompt", type=int, default=3072, help="disk_sigkill: prompt tokens")
    parser.add_argument("--sigkill-cold-files", action="store_true", help="disk_sigkill: drop the block files "
                        "from the page cache after the kill (as after a reboot; default: they stay cached)")
    parser.add_argument("--long-modes", default="off,on", help="preemption_long: modes alternated (amnesia: "
                        "prefix caching off too, the whole context recomputed; slow)")
    args = parser.parse_args()
    from steploop.common.model_path import default_model_dir

    model_dir = default_model_dir()
    pool = args.pool_tokens
    pool_blocks = pool // BLOCK + 1                 # + the null block
    only = args.only.split(",")
    with tempfile.TemporaryDirectory() as disk:
        out = {"machine": machine_info(), "cpu_flags": cpu_flags(), "commit": git_commit()}
        runner = None
        if set(only) - {"preemption_long", "disk_sigkill"}:          # they build their own
            runner = build_runner(model_dir, pool_blocks, host_gib=0.45 * pool / 2048, disk=disk)
            out.update(pool_tokens=pool, host_blocks=runner.tiers.num_host_blocks)
        # 5 conversations from 0.7x to ~0.95x the pool: a working set ~4.5x the pool.
        first, added = int(pool * 0.68), pool // 8
        scenarios = {
            "multi_turn": lambda: alternate(lambda on: multi_turn(runner, on, 5, first, added, 3), args.rounds),
            # A sequence is 0.65 pool: the pool holds ~1.5 of them, so two run and one is preempted as they grow.
            "preemption": lambda: alternate(lambda mode: preemption_heavy(runner, mode, 4, int(pool * 0.45),
                                                                          int(pool * 0.2)),
                                            args.rounds, ("amnesia", "off", "on"), flag=False),
            "no_hits": lambda: alternate(lambda on: no_hits(runner, on, 12, pool // 3, 16), args.rounds),
            "disk_restart": lambda: disk_restart(runner, int(pool * 0.78)),
            "preemption_long": lambda: preemption_long(model_dir, args),
            "disk_sigkill": lambda: disk_sigkill(args.sigkill_prompt, args.rounds, args.sigkill_cold_files)}
        for name in only:
            out[name] = scenarios[name]()
            progress(name, out[name])
        out["load_average_at_end"] = os.getloadavg()
    ratios = {}
    if "multi_turn" in out:
        ratios["returning_ttft_off_over_on"] = (out["multi_turn"]["off"]["mean_returning_ttft_s"]
                                                / out["multi_turn"]["on"]["mean_returning_ttft_s"])
    if "preemption" in out:
        pre = out["preemption"]
        ratios["preemption_total_off_over_on"] = pre["off"]["total_s"] / pre["on"]["total_s"]
        ratios["preemption_p99_ttft_off_over_on"] = pre["off"]["p99_ttft_s"] / pre["on"]["p99_ttft_s"]
        ratios["preemption_total_amnesia_over_on"] = pre["amnesia"]["total_s"] / pre["on"]["total_s"]
    if "preemption_long" in out:
        pre = out["preemption_long"]
        for a, b in (("off", "on"), ("amnesia", "on"), ("amnesia", "off")):
            if a not in pre or b not in pre:
                continue
            ratios[f"preemption_long_total_{a}_over_{b}"] = pre[a]["total_s"] / pre[b]["total_s"]
            ratios[f"preemption_long_p99_ttft_{a}_over_{b}"] = pre[a]["p99_ttft_s"] / pre[b]["p99_ttft_s"]
        rounds = pre["rounds"]
        ratios["preemption_long_total_off_over_on_per_round"] = [
            off["total_s"] / on["total_s"] for off, on in zip(rounds["off"], rounds["on"])]
        # Both modes run the same decode-only steps: their time per step gauges how fast the shared machine was
        # during that run. Totals in units of that step time take most of the machine's drift out.
        per_step = lambda run: run["total_s"] / (run["decode_only_s"] / run["decode_only_steps"])
        ratios["preemption_long_total_off_over_on_in_decode_steps_per_round"] = [
            per_step(off) / per_step(on) for off, on in zip(rounds["off"], rounds["on"])]
        ratios["preemption_long_p99_ttft_off_over_on_per_round"] = [
            off["p99_ttft_s"] / on["p99_ttft_s"] for off, on in zip(rounds["off"], rounds["on"])]
    if "no_hits" in out:
        ratios["no_hits_throughput_on_over_off"] = out["no_hits"]["on"]["tok_s"] / out["no_hits"]["off"]["tok_s"]
    if "disk_restart" in out:
        ratios["disk_ttft_cold_over_disk"] = out["disk_restart"]["cold_ttft_s"] / out["disk_restart"]["disk_ttft_s"]
    if "disk_sigkill" in out:
        ratios["disk_sigkill_ttft_cold_over_disk"] = out["disk_sigkill"]["cold_over_disk"]
    out["ratios"] = ratios
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=2, default=str))
    print(json.dumps(ratios, indent=2))


if __name__ == "__main__":
    main()
