"""The GPU part of the tensor-parallel check (benchmarks/gpu_check.sh runs it on hosts with 2+ GPUs):
python -m benchmarks.tp_gpu_check --world-size 2

Ranks 0..N-1 as ModelRunners on cuda:0..N-1 in one process over a real NCCL group, on a small random Llama whose
heads divide by N (fp32), against transformers' greedy tokens on the same weights. Writes
benchmarks/results/tp_gpu_check.json; exits 1 when the tokens differ.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "tp_gpu_check.json"
PROMPTS = [[1, 510, 1250, 282, 3224, 314, 30, 2438, 28, 1024], list(range(100, 160))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    import torch

    from steploop.common.model_path import default_model_dir
    from tests.tp.tp_models import build_llama, run_ranks
    from tests.worker.family_models import load_oracle

    if torch.cuda.device_count() < args.world_size:
        print(f"[tp_gpu_check] skipped: -tp {args.world_size} needs {args.world_size} GPUs, this host has "
              f"{torch.cuda.device_count()}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_llama(Path(tmp), default_model_dir(), num_heads=4 * args.world_size,
                                num_kv_heads=args.world_size, tied=False)
        started = time.perf_counter()
        outputs = run_ranks(model_dir, args.world_size, PROMPTS, args.max_tokens, device="cuda")
        seconds = time.perf_counter() - started
        oracle = load_oracle(model_dir)
        expected = {}
        with torch.no_grad():
            for handle, prompt in enumerate(PROMPTS):
                out = oracle.generate(torch.tensor([prompt]), max_new_tokens=args.max_tokens, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)
                expected[handle] = out[0, len(prompt):].tolist()
    same = all(o == expected for o in outputs)
    report = {"world_size": args.world_size, "backend": "nccl", "tokens_equal_transformers": same,
              "ranks_agree": all(o == outputs[0] for o in outputs), "seconds": round(seconds, 2)}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    print(f"[tp_gpu_check] {report}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
