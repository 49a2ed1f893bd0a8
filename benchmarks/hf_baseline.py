"""HuggingFace transformers `generate` on the same weights (fp32, the converted model folder): one request at a
time, and padded static batches (left padding; every row runs to the batch's longest output, only each
request's own output tokens count; batches run one after another, like compare.py's 2 batches of 64 over 128)."""

from __future__ import annotations

import time

import torch


def load(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@torch.inference_mode()
def one_at_a_time(model, prompts: list[tuple[list[int], int]]) -> dict:
    start, tokens = time.perf_counter(), 0
    for ids, n in prompts:
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        tokens += out.shape[1] - len(ids)
    seconds = time.perf_counter() - start
    return {"requests": len(prompts), "output_tokens": tokens, "seconds": seconds, "output_throughput": tokens / seconds}


@torch.inference_mode()
def static_batches(model, prompts: list[tuple[list[int], int]], batch_size: int) -> dict:
    start, useful, computed = time.perf_counter(), 0, 0
    for b in range(0, len(prompts), batch_size):
        batch = prompts[b:b + batch_size]
        width = max(len(ids) for ids, _ in batch)
        n = max(n for _, n in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (p, _) in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
        computed += (out.shape[1] - width) * len(batch)
        useful += sum(k for _, k in batch)
    seconds = time.perf_counter() - start
    return {"requests": len(prompts), "batch_size": batch_size, "batches": -(-len(prompts) // batch_size),
            "output_tokens": useful,
            "generated_incl_padding": computed, "seconds": seconds, "output_throughput": useful / seconds}


def matmul_flops(hidden: int, intermediate: int, q_out: int, kv_out: int, rows=(64, 256), windows: int = 6,
                 seconds: float = 0.4):
    """fp32 torch.matmul FLOP/s on the model's own layer shapes ([rows, in] x [in, out]), in the mix one layer
    uses (q, k, v, o, gate, up, down): the best of `windows` timings of about `seconds` each, so a moment of
    interference from other processes does not lower the machine's limit."""
    shapes = [(hidden, q_out), (hidden, kv_out), (hidden, kv_out), (q_out, hidden), (hidden, intermediate),
              (hidden, intermediate), (intermediate, hidden)]
    weights = [torch.randn(k, n) for k, n in shapes]
    out = {}
    for m in rows:
        xs = [torch.randn(m, k) for k, _ in shapes]
        flop = sum(2 * m * k * n for k, n in shapes)
        for _ in range(3):
            for x, w in zip(xs, weights):
                torch.matmul(x, w)
        best = 0.0
        for _ in range(windows):
            reps, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                for x, w in zip(xs, weights):
                    torch.matmul(x, w)
                reps += 1
            best = max(best, flop * reps / (time.perf_counter() - start))
        out[m] = best
    return out
