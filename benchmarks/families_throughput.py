"""Output tok/s at 64 concurrent for Qwen3, Gemma 2 and Mixtral: steploop (the in-process scheduler + ModelRunner,
benchmarks/inprocess.py) against transformers `generate` in padded batches of 64 (benchmarks/hf_baseline.py), on the
same random weights, one after the other in one run (so the shared machine's load hits both alike; compare ratios).

Each model is random, built from its transformers config class at about the default model's size (SmolLM2-135M:
hidden 576, 30 layers, 9 heads / 3 KV heads, MLP 1536, vocab 49152): Qwen3 and Gemma 2 with its shapes, Mixtral
with 4 experts of 384 (top 2), so its total parameters match the dense models. Greedy, ignore_eos, fp32 on CPU.

    .venv/bin/python -m benchmarks.families_throughput [--requests 64 --prompt-len 32 --output-len 32]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import tempfile
import time

import torch

from benchmarks import hf_baseline
from steploop.common.model_path import resolve_model

_SHAPE = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
          "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 128,
          "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
CONFIGS = {
    "qwen3": ("Qwen3Config", _SHAPE),
    "gemma2": ("Gemma2Config", {**_SHAPE, "sliding_window": 4096, "query_pre_attn_scalar": 64}),
    "mixtral": ("MixtralConfig", {**_SHAPE, "intermediate_size": 384, "num_local_experts": 4,
                                  "num_experts_per_tok": 2}),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def build(family: str, out: pathlib.Path) -> tuple[pathlib.Path, int]:
    import transformers
    name, kwargs = CONFIGS[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, name)(**kwargs), dtype=torch.float32)
    model.save_pretrained(out)
    default = resolve_model(None)
    for f in TOKENIZER_FILES:
        if (default / f).is_file():
            shutil.copy(default / f, out / f)
    return out, sum(p.numel() for p in model.parameters())


def prompts(n: int, prompt_len: int, output_len: int) -> list[tuple[list[int], int]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(3, 49152, (prompt_len,), generator=gen).tolist(), output_len) for _ in range(n)]


def run_family(family: str, work: pathlib.Path, pairs, threads: int | None) -> dict:
    from benchmarks.inprocess import InProcessEngine
    path, params = build(family, work / family)
    blocks = max(len(pairs) * (-(-(len(pairs[0][0]) + pairs[0][1]) // 16) + 1), 128 // 16) + 8
    engine = InProcessEngine(path, blocks, num_threads=threads)
    engine.run(pairs[:2])                                         # warm-up: first-call costs out of the timing
    start = time.perf_counter()
    metrics, _ = engine.run(pairs, max_concurrency=len(pairs))
    steploop = {"output_throughput": metrics["output_throughput"], "seconds": time.perf_counter() - start}
    del engine
    hf = hf_baseline.load(path)
    hf_baseline.static_batches(hf, pairs[:2], 2)                  # warm-up
    batched = hf_baseline.static_batches(hf, pairs, len(pairs))
    ratio = steploop["output_throughput"] / batched["output_throughput"]
    print(f"{family}: {params / 1e6:.1f} M params: steploop {steploop['output_throughput']:.1f} tok/s, transformers "
          f"padded batch {batched['output_throughput']:.1f} tok/s ({ratio:.2f}x)", flush=True)
    return {"params": params, "steploop": steploop, "hf_padded_batch": batched, "ratio": ratio}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(CONFIGS))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/families_throughput.json"))
    args = parser.parse_args(argv)
    pairs = prompts(args.requests, args.prompt_len, args.output_len)
    results = {"requests": args.requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
               "load_average_start": list(os.getloadavg())}
    with tempfile.TemporaryDirectory(prefix="families-bench-") as tmp:
        for family in args.families.split(","):
            results[family] = run_family(family, pathlib.Path(tmp), pairs, args.threads)
    results["load_average_end"] = list(os.getloadavg())
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
