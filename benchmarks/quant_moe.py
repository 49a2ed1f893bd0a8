"""A quantized mixture-of-experts checkpoint against the same weights in fp32, served by the worker's ModelRunner
in this process: the experts' bytes in memory and the step time of a decode batch and a prompt chunk, alternating
the two runners round by round (this machine's noise moves both alike).

The model is a scaled-down Qwen3-MoE layer stack with random weights (32 experts of 512, top 4, hidden 1024, 4
layers), quantized by the test writer (tests/worker/quant_models.py) as GPTQ int4 group 128; the fp32 model holds
the writer's reference dequantization of the same weights, so both compute the same function.

    PYTHONPATH=. python -m benchmarks.quant_moe [--rounds 3]   # writes benchmarks/results/quant_moe.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time

import torch

from benchmarks.machine import machine_info
from steploop.common.model_path import default_model_dir
from steploop.common.sampling_params import SamplingParams
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.model.moe import SparseMoE
from steploop.gpu_worker.model_runner import ModelRunner
from tests.worker import quant_models
from tests.worker.driver import Driver
from tests.worker.family_models import TOKENIZER_FILES
from tests.worker.quant_models import Spec, build_quant_model

SHAPE = ("Qwen3MoeConfig", {"hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 512,
                            "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4,
                            "head_dim": 64, "num_experts": 32, "num_experts_per_tok": 4, "norm_topk_prob": True,
                            "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False})
SPEC = Spec("gptq", 4, 128, True)


def expert_bytes(runner: ModelRunner) -> int:
    total = 0
    for block in runner.model.modules():
        if isinstance(block, SparseMoE):
            for name in ("w13", "w2"):
                held = block.packed_experts.get(name)
                total += sum(e.nbytes for e in held) if held is not None else \
                    getattr(block, name).numel() * getattr(block, name).element_size()
    return total


def step_seconds(runner: ModelRunner, batch: int, prompt: int, steps: int) -> tuple[float, float]:
    """(seconds of the step that prefills `batch` prompts of `prompt` tokens, median seconds of a decode step)."""
    driver = Driver(runner)
    gen = torch.Generator().manual_seed(0)
    for h in range(batch):
        driver.add(h, torch.randint(3, 40000, (prompt,), generator=gen).tolist(), steps + 1,
                   SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True))
    start = time.perf_counter()
    driver.step(batch * prompt)
    prefill = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        driver.step(1)
        times.append(time.perf_counter() - start)
    runner.reset()
    return prefill, statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    args = p.parse_args(argv)
    quant_models.QUANT_FAMILIES["qwen3_moe_bench"] = SHAPE
    with tempfile.TemporaryDirectory() as tmp:
        quant_path, hf_model = build_quant_model("qwen3_moe_bench", SPEC, pathlib.Path(tmp) / "gptq",
                                                 default_model_dir())
        fp32_path = pathlib.Path(tmp) / "fp32"
        hf_model.save_pretrained(fp32_path)
        for name in TOKENIZER_FILES:                # the same tokenizer beside the fp32 weights
            if (quant_path / name).is_file():
                (fp32_path / name).write_bytes((quant_path / name).read_bytes())
        del hf_model
        runners = {name: ModelRunner.from_config(WorkerConfig(model=str(path), num_kv_blocks=256, max_model_len=512,
                                                              device="cpu"), path)
                   for name, path in (("gptq4", quant_path), ("fp32", fp32_path))}
        rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
        for _ in range(args.rounds):
            for name, runner in runners.items():
                rounds[name].append(step_seconds(runner, args.batch, args.prompt, 16))
        result = {name: {"expert_bytes": expert_bytes(runner),
                         "prefill_step_s": min(r[0] for r in rounds[name]),
                         "decode_step_s": min(r[1] for r in rounds[name]), "rounds": rounds[name]}
                  for name, runner in runners.items()}
    q, f = result["gptq4"], result["fp32"]
    ratios = {"expert_bytes_quant_over_fp32": q["expert_bytes"] / f["expert_bytes"],
              "decode_step_fp32_over_quant": f["decode_step_s"] / q["decode_step_s"],
              "prefill_step_fp32_over_quant": f["prefill_step_s"] / q["prefill_step_s"]}
    for name, r in result.items():
        print(f"{name:6s} experts {r['expert_bytes'] / 2**20:8.1f} MiB  prefill step ({args.batch} x {args.prompt}) "
              f"{r['prefill_step_s'] * 1e3:7.1f} ms  decode step ({args.batch} rows) {r['decode_step_s'] * 1e3:6.1f} ms")
    print(json.dumps(ratios))
    out = pathlib.Path(__file__).parent / "results" / "quant_moe.json"
    out.write_text(json.dumps({"machine": machine_info(), "spec": SPEC.id, "shape": SHAPE[1], "batch": args.batch,
                               "prompt": args.prompt, "threads": torch.get_num_threads(), "results": result,
                               "ratios": ratios}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
