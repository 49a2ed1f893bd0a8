"""gpu_readiness sections `e2e_1b`, `e2e_8b` and `decode`: the worker's ModelRunner, in process, against
transformers on hand-written Llama configs with random weights generated on the device (nothing to download).

e2e: greedy outputs of our runner, checked by teacher forcing: transformers reads prompt + our tokens in one forward
and its argmax at each generated position is compared with ours (so one early flip does not cascade). bf16 with CUDA
graphs: agreement >= 99%; fp32: every token equal; graphs vs eager: identical tokens; one step at the largest batch
(every request's prompt in one step, then a decode of all of them) on a KV cache sized by --gpu-memory-utilization,
without running out of memory.
decode: steps of `batch` requests at `context` tokens each (contexts are prefix-cached: the plan says they are
computed, so no prefill runs), timed, against the HBM bound: (weights read + KV read) / bandwidth.
Dry run: a tiny model, fp32, CPU, no graphs, the same code.
"""

from __future__ import annotations

import pathlib
import random
import tempfile
import time

import torch

from tests.worker.driver import Driver

SHAPES = {   # hand-written: Llama-3.2-1B's shape, and Llama-3-8B's width with fewer layers
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "tie_word_embeddings": True},
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 8, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False},
    "tiny": {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "tie_word_embeddings": False},
}
COMMON = {"max_position_embeddings": 32768 + 512, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}}


class FastDriver(Driver):
    """Driver with an O(1) block pop (the decode section hands out ~65k blocks)."""

    def _grow(self, req, num_tokens: int) -> list[int]:
        need = -(-num_tokens // self.block_size) - len(req.blocks)
        new = [self.free.pop() for _ in range(max(need, 0))]
        req.blocks.extend(new)
        return new


def make_model(shape: str, dtype: torch.dtype, device: str, folder: pathlib.Path):
    """A transformers LlamaForCausalLM with random weights made on `device`, saved to folder; returns it."""
    import transformers

    config = transformers.LlamaConfig(**SHAPES[shape], **COMMON)
    config._attn_implementation = "eager"      # the plainest oracle (sdpa may pick fused kernels of its own)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    model.save_pretrained(folder)
    return model


def make_runner(folder: pathlib.Path, device: str, dtype: str, graphs: bool, num_kv_blocks: int | None,
                max_model_len: int = 2048):
    from steploop.gpu_worker.config import WorkerConfig
    from steploop.gpu_worker.model_runner import ModelRunner

    if num_kv_blocks is not None:                      # at least one sequence of max_model_len, as the worker needs
        num_kv_blocks = max(num_kv_blocks, -(-max_model_len // 16) + 2)
    config = WorkerConfig(model=str(folder), device=device, dtype=dtype, cuda_graphs=graphs,
                          num_kv_blocks=num_kv_blocks, max_model_len=max_model_len,
                          max_num_seqs=256, max_num_batched_tokens=8192,   # max_batch's step: 256 x 32 tokens
                          tune_kernels=dtype != "float32",     # fp32 checks exact tokens: no need to tune it
                          attention_backend="triton" if device == "cuda" else "torch")
    return ModelRunner.from_config(config, folder)


def free(runner) -> None:
    if runner is not None:
        runner.graphs = runner.model = runner.kv_caches = None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length + 7 * i)] for i in range(n)]


def generate(runner, batch: list[list[int]], max_tokens: int) -> dict[int, list[int]]:
    driver = Driver(runner)
    for i, p in enumerate(batch):
        driver.add(i, p, max_tokens)
    return driver.run(chunk=512, max_steps=10 * max_tokens)


def agreement(hf, batch: list[list[int]], outputs: dict[int, list[int]], device: str) -> dict:
    """Teacher-forced: transformers' argmax after each prefix of prompt + our tokens, against our tokens."""
    same = total = 0
    for i, p in enumerate(batch):
        ours = outputs[i]
        ids = torch.tensor([p + ours[:-1]], device=device)
        with torch.no_grad():
            logits = hf(ids).logits[0, len(p) - 1:]
        theirs = logits.argmax(-1).tolist()
        same += sum(a == b for a, b in zip(ours, theirs))
        total += len(ours)
    return {"tokens": total, "agree": same, "agreement": same / max(total, 1)}


def e2e(shape: str, dry: bool) -> dict:
    device = "cpu" if dry else "cuda"
    out: dict = {"shape": SHAPES[shape]}
    n, length, new = (2, 12, 6) if dry else (8, 100, 64)
    with tempfile.TemporaryDirectory(prefix="readiness-") as tmp:
        for dtype in (("float32",) if dry else ("bfloat16", "float32")):
            folder = pathlib.Path(tmp) / dtype
            t0 = time.perf_counter()
            hf = make_model(shape, getattr(torch, dtype), device, folder)
            batch = prompts(n, length, SHAPES[shape]["vocab_size"])
            row: dict = {"make_model_s": round(time.perf_counter() - t0, 1)}
            # graphs vs eager once (bf16); fp32 runs the serving path (graphs) only, to fit the time limit
            modes = (False,) if dry else (True, False) if dtype == "bfloat16" else (True,)
            got = {}
            for graphs in modes:
                t0 = time.perf_counter()
                runner = make_runner(folder, device, dtype, graphs, num_kv_blocks=n * (length + 7 * n + new) // 16 + 64)
                row[f"load_{'graphs' if graphs else 'eager'}_s"] = round(time.perf_counter() - t0, 1)
                got[graphs] = generate(runner, batch, new)
                row["cuda_graphs_captured"] = row.get("cuda_graphs_captured") or runner.graphs is not None
                free(runner)
            ours = got[modes[0]]
            row.update(agreement(hf, batch, ours, device))
            if len(modes) == 2:
                row["graphs_equal_eager"] = got[True] == got[False]
            need = 0.99 if dtype == "bfloat16" else 1.0
            row["ok"] = row["agreement"] >= need and row.get("graphs_equal_eager", True)
            out[dtype] = row
            del hf
            free(None)
            if dtype == "bfloat16" or dry:
                out["max_batch"] = max_batch(folder, device, dtype, dry)
    out["ok"] = all(v.get("ok", True) for v in out.values() if isinstance(v, dict))
    return out


def max_batch(folder: pathlib.Path, device: str, dtype: str, dry: bool) -> dict:
    """The KV cache sized by --gpu-memory-utilization (0.9), then the largest step the scheduler sends (8192
    prompt tokens over 256 requests) and a 256-request decode step: peak memory, no out-of-memory."""
    from steploop.gpu_worker.capture_plan import DECODE_SIZES

    reqs, plen = (4, 8) if dry else (DECODE_SIZES[-1], 32)
    t0 = time.perf_counter()
    runner = make_runner(folder, device, dtype, not dry, num_kv_blocks=64 if dry else None, max_model_len=4096)
    if not dry:
        torch.cuda.reset_peak_memory_stats()
    driver = FastDriver(runner)
    for i, p in enumerate(prompts(reqs, plen, runner.vocab_size, seed=1)):
        driver.add(i, p[:plen], 2)
    driver.step(plen)          # every prompt in one step
    driver.step(1)             # every request decodes
    row = {"requests": reqs, "prompt_tokens_in_one_step": reqs * plen, "num_kv_blocks": runner.info.num_kv_blocks,
           "seconds": round(time.perf_counter() - t0, 1), "ok": True}
    if not dry:
        row.update(peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                   total_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 2))
    free(runner)
    return row


def decode(dry: bool, hbm_gbs: float | None) -> dict:
    """Step time at batch x context on the 8B-width model (bf16, CUDA graphs), as a fraction of the bound."""
    device, dtype, shape = ("cpu", "float32", "tiny") if dry else ("cuda", "bfloat16", "8b")
    batches, contexts = ((1, 2), (32, 64)) if dry else ((1, 8, 32, 128), (1024, 4096, 32768))
    token_budget = 64 * 4 if dry else 1 << 21          # KV tokens held at once (2 Mi: 64 GiB at 8 layers, bf16)
    cfg = SHAPES[shape]
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * (4 if dry else 2)
    rows = []
    with tempfile.TemporaryDirectory(prefix="readiness-") as tmp:
        folder = pathlib.Path(tmp)
        hf = make_model(shape, getattr(torch, dtype), device, folder)
        weight_bytes = sum(p.numel() * p.element_size() for n, p in hf.named_parameters() if "embed_tokens" not in n)
        del hf
        runner = make_runner(folder, device, dtype, not dry, num_kv_blocks=token_budget // 16 + 2 * max(batches) + 8,
                             max_model_len=max(contexts) + 64)
        for ctx in contexts:
            for b in batches:
                if b * (ctx + 16) > token_budget:
                    rows.append({"batch": b, "context": ctx, "skipped": "over the KV token budget"})
                    continue
                rows.append(_decode_case(runner, b, ctx, 3 if dry else 20, weight_bytes, kv_per_token, hbm_gbs))
        free(runner)
    batch1 = [r for r in rows if r.get("batch") == 1 and r.get("fraction_of_bound") is not None]
    return {"shape": shape, "weight_bytes": weight_bytes, "hbm_gb_per_s": hbm_gbs, "rows": rows, "ok": True,
            "batch1_fraction_of_bound": min((r["fraction_of_bound"] for r in batch1), default=None)}


def _decode_case(runner, batch: int, ctx: int, steps: int, weight_bytes: int, kv_per_token: int,
                 hbm_gbs: float | None) -> dict:
    runner.reset()
    driver = FastDriver(runner)
    for i in range(batch):
        driver.add(i, [3 + (i + j) % 500 for j in range(ctx)], steps + 3)
        driver.requests[i].num_computed = ctx - 1      # prefix-cached: the step decodes at position ctx - 1
    driver.step(1)
    driver.step(1)                                      # warm: the request state exists, graphs replay
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        driver.step(1)
    sync()
    step_s = (time.perf_counter() - t0) / steps
    moved = weight_bytes + batch * (ctx + 2) * kv_per_token
    bound_s = moved / (hbm_gbs * 1e9) if hbm_gbs else None
    return {"batch": batch, "context": ctx, "step_ms": round(step_s * 1e3, 3), "bytes_per_step": moved,
            "bound_ms": round(bound_s * 1e3, 3) if bound_s else None,
            "fraction_of_bound": round(bound_s / step_s, 3) if bound_s else None,
            "tok_per_s": round(batch / step_s, 1)}
