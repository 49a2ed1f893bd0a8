"""gpu_readiness sections `e2e_1b`, `e2e_8b` and `decode`: the worker's ModelRunner, in process, against
transformers on hand-written Llama configs with random weights generated on the device (nothing to download).

e2e: greedy outputs of our runner, checked by teacher forcing: transformers reads prompt + our tokens in one forward
and its argmax at each generated position is compared with ours (so one early flip does not cascade).
- fp32 with CUDA graphs: every token equal to transformers fp32.
- bf16, with graphs and eagerly: judged against the fp32 truth (transformers fp32 on the same bf16 weights), with
  transformers' own bf16 as the yardstick. A random-weight model's logits are nearly flat, so bf16 rounding alone
  moves many argmaxes (transformers bf16 agreed with its own fp32 on 25% of tokens at initializer_range 0.2, 82%
  at 0.02, on the 1B shape on the CPU), and a fixed agreement bar would judge the model, not the engine. Ours passes
  when its agreement with fp32 is within 0.05 of transformers bf16's (two tokens on a short run), and the mean
  error of its logprob of each token against fp32's is at most twice transformers bf16's (+0.01). Graphs and eager
  are judged the same way; their tokens may differ (a graph pads the batch, and GEMMs at another row count round
  differently), which is reported.
- one step at the largest batch (every request's prompt in one step, then a decode of all of them) on a KV cache
  sized by --gpu-memory-utilization, without running out of memory.
decode: steps of `batch` requests at `context` tokens each (contexts are prefix-cached: the plan says they are
computed, so no prefill runs), timed, against the HBM bound: (weights read + KV read) / bandwidth; the graph's own
GPU time is timed by replaying it, so the host's share of a step shows.
Dry run: a tiny model on the CPU, fp32 and bf16, no graphs, the same code.
"""

from __future__ import annotations

import copy
import io
import pathlib
import random
import tempfile
import time

import torch
from steploop.common.sampling_params import SamplingParams

from tests.worker.driver import Driver, InFlightDriver

SHAPES = {   # hand-written: Llama-3.2-1B's shape, and Llama-3-8B's width with fewer layers
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "tie_word_embeddings": True},
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 8, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False},
    "8b_full": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False},
    "tiny": {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "tie_word_embeddings": False},
}
# initializer_range 0.02 (transformers' default): at 0.2 a random Llama is chaotic (logits' relative error from bf16
# rounding alone was 54% on the 1B shape), so no bf16 engine can be told from a wrong one
COMMON = {"max_position_embeddings": 32768 + 512, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}}


class FastDriver(Driver):
    """Driver with an O(1) block pop (the decode section hands out ~65k blocks)."""

    def _grow(self, req, num_tokens: int) -> list[int]:
        need = -(-num_tokens // self.block_size) - len(req.blocks)
        new = [self.free.pop() for _ in range(max(need, 0))]
        req.blocks.extend(new)
        return new


class FastInFlightDriver(InFlightDriver):
    _grow = FastDriver._grow


def make_model(shape: str, dtype: torch.dtype, device: str, folder: pathlib.Path):
    """A transformers LlamaForCausalLM with random weights made on `device`, saved to folder; returns it. Its rope
    inverse frequencies stay fp32: `.to(bfloat16)` would round that buffer too, and transformers' bf16 forward would
    then rotate by other angles than its fp32 one (0.15 apart in cos by position 90), which made the first H200 runs'
    fp32 truth, an upcast copy, wrong by the same amount; engines (vLLM, this one) keep the frequencies fp32."""
    import transformers

    config = transformers.LlamaConfig(**SHAPES[shape], **COMMON)
    config._attn_implementation = "eager"      # the plainest oracle (sdpa may pick fused kernels of its own)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).eval()
    rope = {name: buf.clone() for name, buf in model.named_buffers() if name.endswith("inv_freq")}
    model = model.to(dtype)
    for name, buf in rope.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner).register_buffer(leaf, buf, persistent=False)
    model.save_pretrained(folder)
    return model


def make_runner(folder: pathlib.Path, device: str, dtype: str, graphs: bool, num_kv_blocks: int | None,
                max_model_len: int = 2048, attention_backend: str | None = None):
    from steploop.gpu_worker.config import WorkerConfig
    from steploop.gpu_worker.model_runner import ModelRunner

    if num_kv_blocks is not None:                      # at least one sequence of max_model_len, as the worker needs
        num_kv_blocks = max(num_kv_blocks, -(-max_model_len // 16) + 2)
    config = WorkerConfig(model=str(folder), device=device, dtype=dtype, cuda_graphs=graphs,
                          num_kv_blocks=num_kv_blocks, max_model_len=max_model_len,
                          max_num_seqs=256, max_num_batched_tokens=8192,   # max_batch's step: 256 x 32 tokens
                          tune_kernels=dtype != "float32",     # fp32 checks exact tokens: no need to tune it
                          attention_backend=attention_backend or ("triton" if device == "cuda" else "torch"))
    return ModelRunner.from_config(config, folder)


def free(runner) -> None:
    if runner is not None:
        runner.graphs = runner.model = runner.kv_caches = None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length + 7 * i)] for i in range(n)]


def generate(runner, batch: list[list[int]], max_tokens: int,
             in_flight: bool = False) -> tuple[dict[int, list[int]], dict[int, list[float]]]:
    """Greedy outputs and the logprob of each sampled token; in_flight: as the worker serves on a GPU, step N+1
    launched before step N is finished (step_overlap.py), else each step finished first."""
    runner.keep_in_flight = in_flight
    driver = (InFlightDriver if in_flight else Driver)(runner)
    for i, p in enumerate(batch):
        driver.add(i, p, max_tokens, SamplingParams(max_tokens=max_tokens, logprobs=0))
    outputs = driver.run(chunk=512, max_steps=10 * max_tokens)
    logprobs: dict[int, list[float]] = {i: [] for i in range(len(batch))}
    for result in driver.results:
        for handle, lps in result.logprobs.items():
            if handle in result.sampled:
                logprobs[handle].extend(lp.logprob for lp in lps)
    return outputs, {i: lps[:max_tokens] for i, lps in logprobs.items()}


def teacher_forced(hf, batch: list[list[int]], outputs: dict[int, list[int]], device: str) -> list[torch.Tensor]:
    """transformers' log-softmax at each generated position, reading prompt + our tokens: [new, vocab] per prompt."""
    rows = []
    for i, p in enumerate(batch):
        ids = torch.tensor([p + outputs[i][:-1]], device=device)
        with torch.no_grad():
            rows.append(hf(ids).logits[0, len(p) - 1:].float().log_softmax(-1))
    return rows


def agreement(truth: list[torch.Tensor], outputs: dict[int, list[int]]) -> dict:
    """Our tokens against the argmax of `truth` (teacher-forced log-softmax rows)."""
    same = total = 0
    for i, rows in enumerate(truth):
        theirs = rows.argmax(-1).tolist()
        same += sum(a == b for a, b in zip(outputs[i], theirs))
        total += len(outputs[i])
    return {"tokens": total, "agree": same, "agreement": same / max(total, 1)}


def exact_fp32(hf32, batch: list[list[int]], outputs: dict[int, list[int]], logprobs: dict[int, list[float]],
               device: str) -> dict:
    """fp32 against transformers fp32: every token equal, except where transformers' own top two are within
    1e-4 (a tie that summation order alone decides), and each sampled token's logprob within 1e-3."""
    truth = teacher_forced(hf32, batch, outputs, device)
    row = agreement(truth, outputs)
    err, ties_flipped, real_flips = 0.0, 0, []
    for i, rows in enumerate(truth):
        tok = torch.tensor(outputs[i], device=rows.device)
        err = max(err, (torch.tensor(logprobs[i], device=rows.device) - rows.gather(1, tok[:, None])[:, 0])
                  .abs().max().item())
        for j, (ours, theirs) in enumerate(zip(outputs[i], rows.argmax(-1).tolist())):
            if ours != theirs:
                gap = (rows[j, theirs] - rows[j, ours]).item()
                if gap < 1e-4:
                    ties_flipped += 1
                else:
                    real_flips.append({"prompt": i, "position": j, "gap": gap})
    row.update(max_logprob_err=err, ties_flipped=ties_flipped, flips=real_flips[:8])
    row["ok"] = not real_flips and err < 1e-3
    return row


def against_fp32(hf16, batch: list[list[int]], outputs: dict[int, list[int]], logprobs: dict[int, list[float]],
                 device: str) -> dict:
    """Our bf16 outputs against the fp32 truth, beside transformers bf16's distance from it on the same tokens."""
    hf32 = copy.deepcopy(hf16).float()
    truth = teacher_forced(hf32, batch, outputs, device)
    del hf32
    theirs16 = teacher_forced(hf16, batch, outputs, device)
    ours_err = hf_err = n = 0.0
    hf_same = 0
    for i, rows in enumerate(truth):
        tok = torch.tensor(outputs[i], device=rows.device)
        at32 = rows.gather(1, tok[:, None])[:, 0]
        at16 = theirs16[i].gather(1, tok[:, None])[:, 0]
        ours_err += (torch.tensor(logprobs[i], device=rows.device) - at32).abs().sum().item()
        hf_err += (at16 - at32).abs().sum().item()
        hf_same += (theirs16[i].argmax(-1) == rows.argmax(-1)).sum().item()
        n += len(outputs[i])
    row = agreement(truth, outputs)
    row.update(hf_bf16_agreement=round(hf_same / max(n, 1), 4), logprob_err=round(ours_err / max(n, 1), 5),
               hf_bf16_logprob_err=round(hf_err / max(n, 1), 5))
    slack = max(0.05, 2 / max(n, 1))       # two tokens' worth on a short run (the dry run's 12)
    row["ok"] = (row["agreement"] >= row["hf_bf16_agreement"] - slack
                 and row["logprob_err"] <= 2 * row["hf_bf16_logprob_err"] + 0.01)
    return row


def e2e(shape: str, dry: bool) -> dict:
    device = "cpu" if dry else "cuda"
    out: dict = {"shape": SHAPES[shape]}
    n, length, new = (2, 12, 6) if dry else (8, 100, 64)
    with tempfile.TemporaryDirectory(prefix="readiness-") as tmp:
        for dtype in ("bfloat16", "float32"):
            folder = pathlib.Path(tmp) / dtype
            t0 = time.perf_counter()
            hf = make_model(shape, getattr(torch, dtype), device, folder)
            batch = prompts(n, length, SHAPES[shape]["vocab_size"])
            row: dict = {"make_model_s": round(time.perf_counter() - t0, 1)}
            # bf16: graphs and eager, each against fp32, and (reported, not judged) eager with the torch attention
            # backend and torch elementwise ops, which says whether the Triton kernels carry any excess error;
            # fp32: the serving path (graphs), exact
            # (graphs, attention backend; None: the device's default)
            modes = ((False, None),) if dry else ((True, None), (False, None), (False, "torch")) \
                if dtype == "bfloat16" else ((True, None),)
            by_mode = {}
            for graphs, backend in modes:
                mode = ("graphs" if graphs else "eager") + ("_torch_ops" if backend == "torch" else "")
                t0 = time.perf_counter()
                runner = make_runner(folder, device, dtype, graphs, num_kv_blocks=n * (length + 7 * n + new) // 16 + 64,
                                     attention_backend=backend)
                row[f"load_{mode}_s"] = round(time.perf_counter() - t0, 1)
                # the serving path (graphs; and the dry run's one mode) keeps a step in flight, as served
                tokens, logprobs = generate(runner, batch, new, in_flight=graphs or dry)
                row["cuda_graphs_captured"] = row.get("cuda_graphs_captured") or runner.graphs is not None
                free(runner)
                if dtype == "bfloat16":
                    row[mode] = against_fp32(hf, batch, tokens, logprobs, device)
                else:
                    row.update(exact_fp32(hf, batch, tokens, logprobs, device))
                by_mode[mode] = tokens
            if "graphs" in by_mode and "eager" in by_mode:
                row["graphs_equal_eager"] = by_mode["graphs"] == by_mode["eager"]
                row["graphs_eager_same_tokens"] = sum(a == b for i in by_mode["graphs"] for a, b in
                                                      zip(by_mode["graphs"][i], by_mode["eager"][i]))
            if dtype == "bfloat16":
                row["ok"] = all(row[m]["ok"] for m in by_mode if not m.endswith("_torch_ops"))
            out[dtype] = row
            del hf
            free(None)
            if dtype == "bfloat16":
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
    """Step time at batch x context on Llama-3-8B's whole shape (32 layers, bf16, CUDA graphs), as a fraction of
    the bound: with fewer layers the host's fixed share of a step would count several times over."""
    device, dtype, shape = ("cpu", "float32", "tiny") if dry else ("cuda", "bfloat16", "8b_full")
    batches, contexts = ((1, 2), (32, 64)) if dry else ((1, 8, 32, 128), (1024, 4096, 32768))
    token_budget = 64 * 4 if dry else 1 << 19          # KV tokens held at once (512 Ki: 64 GiB at 32 layers, bf16)
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
        profile = _host_profile(runner, batches[0], contexts[0], 3 if dry else 30)
        for ctx in contexts:
            for b in batches:
                if b * (ctx + 16) > token_budget:
                    rows.append({"batch": b, "context": ctx, "skipped": "over the KV token budget"})
                    continue
                rows.append(_decode_case(runner, b, ctx, 3 if dry else 20, weight_bytes, kv_per_token, hbm_gbs))
        free(runner)
    batch1 = [r for r in rows if r.get("batch") == 1 and r.get("fraction_of_bound") is not None]
    return {"shape": shape, "weight_bytes": weight_bytes, "hbm_gb_per_s": hbm_gbs, "rows": rows, "ok": True,
            "host_profile": profile,
            "batch1_fraction_of_bound": min((r["fraction_of_bound"] for r in batch1), default=None)}


def _decoding(runner, batch: int, ctx: int, steps: int, in_flight: bool = False) -> FastDriver:
    """`batch` requests at `ctx` tokens each, decoding, warm (their state exists, graphs replay), with `steps` + 1
    decode steps left; in_flight: a step kept in flight (step_overlap.py), as the worker serves on a GPU."""
    runner.reset()
    runner.keep_in_flight = in_flight
    driver = (FastInFlightDriver if in_flight else FastDriver)(runner)
    for i in range(batch):
        driver.add(i, [3 + (i + j) % 500 for j in range(ctx)], steps + 4)
        driver.requests[i].num_computed = ctx - 1      # prefix-cached: the step decodes at position ctx - 1
    driver.step(1)
    driver.step(1)
    return driver


def _decode_case(runner, batch: int, ctx: int, steps: int, weight_bytes: int, kv_per_token: int,
                 hbm_gbs: float | None) -> dict:
    """The step time as served (a step kept in flight: the host prepares step N+1 while step N runs), and with
    each step finished before the next is prepared (the host's time adds to the GPU's)."""
    moved = weight_bytes + batch * (ctx + 2) * kv_per_token
    bound_s = moved / (hbm_gbs * 1e9) if hbm_gbs else None
    serial_s, host_s = _timed_steps(runner, batch, ctx, steps, in_flight=False)
    step_s, _ = _timed_steps(runner, batch, ctx, steps, in_flight=True)
    row = {"batch": batch, "context": ctx, "step_ms": round(step_s * 1e3, 3), "bytes_per_step": moved,
           "bound_ms": round(bound_s * 1e3, 3) if bound_s else None,
           "fraction_of_bound": round(bound_s / step_s, 3) if bound_s else None,
           "tok_per_s": round(batch / step_s, 1), "serial_step_ms": round(serial_s * 1e3, 3),
           "serial_fraction_of_bound": round(bound_s / serial_s, 3) if bound_s else None,
           "execute_ms": round(host_s * 1e3, 3)}
    gpu_ms = _graph_gpu_ms(runner, _decoding(runner, batch, ctx, steps), steps)
    if gpu_ms is not None:
        row.update(graph_gpu_ms=round(gpu_ms, 3), host_ms=round(row["execute_ms"] - gpu_ms, 3),
                   graph_fraction_of_bound=round(bound_s * 1e3 / gpu_ms, 3) if bound_s else None)
    return row


def _timed_steps(runner, batch: int, ctx: int, steps: int, in_flight: bool) -> tuple[float, float]:
    """Seconds per decode step, and of it the runner's own (execute: the serial steps only, the test driver's
    plan building left out)."""
    driver = _decoding(runner, batch, ctx, steps, in_flight)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    inner = runner.execute
    in_execute = [0.0]

    def timed(plan):                                    # the runner's share of a step (the driver's is not ours)
        t = time.perf_counter()
        try:
            return inner(plan)
        finally:
            in_execute[0] += time.perf_counter() - t

    runner.execute = timed
    t0 = time.perf_counter()
    try:
        for _ in range(steps):
            driver.step(1)
        if in_flight:
            driver.drain()
        sync()
    finally:
        del runner.execute
    return (time.perf_counter() - t0) / steps, in_execute[0] / steps


def _host_profile(runner, batch: int, ctx: int, steps: int, top: int = 25) -> list[str]:
    """Where the runner's time goes in `steps` decode steps (cProfile, own time first): the host share of a step."""
    import cProfile
    import pstats

    driver = _decoding(runner, batch, ctx, steps)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        driver.step(1)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return [line for line in out.getvalue().splitlines() if line.strip()][-top - 1:]


def _graph_gpu_ms(runner, driver, reps: int) -> float | None:
    """The forward's GPU time alone: the graph the next decode step replays, replayed back to back (it rewrites
    the same KV slots). None without captured graphs or when the step ran eagerly."""
    graphs = getattr(runner, "graphs", None)
    if graphs is None or not graphs.capture or not torch.cuda.is_available():
        return None
    before = dict(graphs.replays)
    driver.step(1)
    used = [k for k, v in graphs.replays.items() if v != before.get(k, 0)]
    if len(used) != 1:
        return None
    graph, _ = graphs.graphs[used[0]]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps
