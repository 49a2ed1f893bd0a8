"""A mixture-of-experts model's step time at -tp 1, -tp 2 sharded and -tp 2 --enable-expert-parallel, side by side in
one run (modes alternated per round): python -m benchmarks.moe_tp_step [--rounds 2]

A random Mixtral (transformers' MixtralConfig: 4 layers, hidden 256, 8 experts of 512 rows, top-2) served by
ModelRunner ranks in spawned processes over gloo on loopback, the CPUs split between the ranks as `serve -tp N`
splits them. Each run: 16 prompts of 48 tokens in one prefill step, then 24 decode steps of 16 tokens. Reported
per mode: the prefill step's forward, the median decode step's forward, and rank 0's time in collectives per
decode step. Writes benchmarks/results/moe_tp_step.json with the machine it ran on (benchmarks/machine.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
from datetime import timedelta

RESULTS = pathlib.Path(__file__).parent / "results" / "moe_tp_step.json"
MODES = (("tp1", 1, False), ("tp2-sharded", 2, False), ("tp2-expert-parallel", 2, True))
PROMPTS, PROMPT_LEN, DECODE_STEPS = 16, 48, 24


def build_model(out: pathlib.Path) -> pathlib.Path:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from steploop.common.model_path import default_model_dir
    from tests.worker.family_models import TOKENIZER_FILES, VOCAB
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_local_experts=8,
                           num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=False)
    MixtralForCausalLM(config).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (default_model_dir() / name).is_file():
            shutil.copy(default_model_dir() / name, out / name)
    return out


def _rank(rank: int, size: int, expert_parallel: bool, model: str, address: str, threads: int, out) -> None:
    import torch

    from steploop.common.sampling_params import SamplingParams
    from steploop.gpu_worker.config import WorkerConfig
    from steploop.gpu_worker.distributed.process_group import form_group
    from steploop.gpu_worker.model_runner import ModelRunner
    from tests.worker.driver import Driver

    config = WorkerConfig(model=model, num_kv_blocks=128, max_model_len=256, device="cpu", dtype="float32",
                          tensor_parallel_size=size, rank=rank, num_threads=threads,
                          enable_expert_parallel=expert_parallel)
    runner = ModelRunner.from_config(config, pathlib.Path(model))
    if size > 1:
        timeout = timedelta(seconds=120)
        runner.tp_comm.attach(form_group(rank, size, address, 1, timeout, "127.0.0.1", torch.device("cpu"), None),
                              1, timeout)
    driver = Driver(runner)
    gen = torch.Generator().manual_seed(1)
    for h in range(PROMPTS):
        driver.add(h, torch.randint(3, 40000, (PROMPT_LEN,), generator=gen).tolist(), DECODE_STEPS + 1,
                   SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 1, ignore_eos=True))
    prefill = driver.step(512)
    decodes = [driver.step(512) for _ in range(DECODE_STEPS)]
    if rank == 0:
        out.put({"prefill_ms": 1e3 * prefill.forward_seconds,
                 "decode_ms": 1e3 * statistics.median(r.forward_seconds for r in decodes),
                 "decode_collective_ms": 1e3 * statistics.median(r.collective_seconds for r in decodes)})


def run_mode(model: pathlib.Path, size: int, expert_parallel: bool) -> dict:
    from steploop.gpu_worker.distributed.process_group import GroupStore
    store = GroupStore("127.0.0.1", size)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    threads = max(1, len(os.sched_getaffinity(0)) // size)
    procs = [ctx.Process(target=_rank, args=(r, size, expert_parallel, str(model), store.address, threads, out))
             for r in range(size)]
    for p in procs:
        p.start()
    result = out.get(timeout=900)
    for p in procs:
        p.join(60)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from benchmarks.machine import git_commit, machine_info
    rows: dict[str, list[dict]] = {name: [] for name, _, _ in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(pathlib.Path(tmp) / "mixtral")
        for round_ in range(args.rounds):
            for name, size, ep in (MODES if round_ % 2 == 0 else tuple(reversed(MODES))):
                rows[name].append(run_mode(model, size, ep))
                print(f"[moe_tp_step] round {round_} {name}: {rows[name][-1]}", flush=True)
    summary = {name: {k: round(min(r[k] for r in runs), 2) for k in runs[0]} for name, runs in rows.items()}
    report = {"commit": git_commit(), "machine": machine_info(), "rounds": rows, "best": summary}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    for name, best in summary.items():
        print(f"{name:22s} prefill {best['prefill_ms']:8.1f} ms  decode {best['decode_ms']:7.1f} ms/step  "
              f"collectives {best['decode_collective_ms']:6.2f} ms/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
