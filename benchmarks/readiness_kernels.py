"""gpu_readiness section `kernels`: every Triton kernel against its fp32 torch reference (kernels/reference.py,
kernels/lora_reference.py) at serving shapes: 32 query / 8 KV heads, head sizes 64 and 128, block 16, decode at
contexts 4k and 32k, an 8k prefill, mixed steps, window + soft-cap, a KV cache over 2^31 elements (int64 offsets),
fused MoE and LoRA shrink/expand. Each case records its max abs error, the bound it was held to and its time; one
failing case does not stop the others. Dry run: the same cases at tiny shapes, interpreted (TRITON_INTERPRET=1 is
set by the parent for this section's subprocess), fp32.
"""

from __future__ import annotations

import pathlib
import time
import traceback
from collections.abc import Callable

import numpy as np
import torch

# (atol, rtol) against the fp32 references, as tests/kernels/conftest.py
TOL = {torch.float32: (2e-5, 1e-4), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}


def compare(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> dict:
    atol, rtol = TOL[dtype]
    got, want = got.float(), want.float()
    err = (got - want).abs()
    bound = atol * scale + rtol * scale * want.abs()
    return {"max_abs_err": float(err.max()) if err.numel() else 0.0, "atol": atol * scale, "rtol": rtol * scale,
            "ok": bool((err <= bound).all()) and bool(torch.isfinite(got).all())}


def _paged(query_lens: list[int], seq_lens: list[int], h: int, hk: int, d: int, dtype, device,
           extra_blocks: int = 0, high_blocks: bool = False, seed: int = 0):
    """q, a paged cache [2, N, 16, hk, d] and block tables; high_blocks puts every request's blocks at the end
    of the cache (the far offsets a >2^31-element cache needs int64 for)."""
    g = torch.Generator(device=device).manual_seed(seed)
    bs = 16
    per_req = [-(-s // bs) for s in seq_lens]
    used = sum(per_req)
    num_blocks = used + 1 + extra_blocks
    cache = torch.empty((2, num_blocks, bs, hk, d), dtype=dtype, device=device)
    first = num_blocks - used if high_blocks else 1
    cache[:, first:].normal_(generator=g)
    cache[:, :first].zero_()
    ids = torch.arange(first, first + used, device=device, dtype=torch.int32)
    ids = ids[torch.randperm(used, generator=g, device=device)]
    tables = torch.zeros((len(seq_lens), max(per_req)), dtype=torch.int32, device=device)
    start = 0
    for r, n in enumerate(per_req):
        tables[r, :n] = ids[start:start + n]
        start += n
    q = torch.randn((sum(query_lens), h, d), generator=g, dtype=torch.float32, device=device).to(dtype)
    return q, cache, tables


def attention_case(query_lens, seq_lens, h, hk, d, dtype, device, window=None, softcap=None, **cache_kw) -> dict:
    from steploop.gpu_worker.kernels.paged_attention import plan_attention, unified_attention
    from steploop.gpu_worker.kernels.reference import paged_attention_ref

    q, cache, tables = _paged(query_lens, seq_lens, h, hk, d, dtype, device, **cache_kw)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32, device=device)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    plan = plan_attention(qsl, seq, tables, np.array(query_lens, np.int32), np.array(seq_lens, np.int32), h, hk)
    out = torch.empty_like(q)
    scale = d ** -0.5
    t0 = time.perf_counter()
    unified_attention(q, cache, out, plan, scale, window, softcap)
    _sync(device)
    seconds = time.perf_counter() - t0
    want = paged_attention_ref(q, cache, query_lens, seq_lens, tables, scale, window, softcap)
    return {**compare(out, want, dtype), "num_splits": plan.num_splits, "cache_elements": cache.numel(),
            "first_call_s": round(seconds, 3)}


def fp8_attention_case(query_lens, seq_lens, h, hk, d, dtype, device, kv_dtype) -> dict:
    """An FP8 KV cache (--kv-cache-dtype): the kernel writes the step's K/V through the scales, then attends over
    the cache; the reference attends over the dequantized cache in fp32."""
    from steploop.gpu_worker import kv_cache_dtype
    from steploop.gpu_worker.kernels.cache_write import write_kv_cache
    from steploop.gpu_worker.kernels.paged_attention import plan_attention, unified_attention
    from steploop.gpu_worker.kernels.reference import paged_attention_ref

    q, cache, tables = _paged(query_lens, seq_lens, h, hk, d, dtype, device)
    scales = (torch.tensor([0.05], device=device), torch.tensor([0.02], device=device))
    fp8 = torch.stack([kv_cache_dtype.quantize(cache[i], scales[i], kv_dtype) for i in range(2)])
    slots = torch.arange(16, 16 + sum(query_lens), device=device, dtype=torch.int64)   # blocks the tables read
    write_kv_cache(q[:, :hk], q[:, :hk], fp8, slots, scales)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32, device=device)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    plan = plan_attention(qsl, seq, tables, np.array(query_lens, np.int32), np.array(seq_lens, np.int32), h, hk)
    out = torch.empty_like(q)
    t0 = time.perf_counter()
    unified_attention(q, fp8, out, plan, d ** -0.5, kv_scales=scales)
    _sync(device)
    seconds = time.perf_counter() - t0
    deq = torch.stack([kv_cache_dtype.dequantize(fp8[i], scales[i]) for i in range(2)])
    want = paged_attention_ref(q.float(), deq, query_lens, seq_lens, tables, d ** -0.5)
    written = kv_cache_dtype.quantize(q[:, :hk], scales[0], kv_dtype).view(torch.uint8)
    stored = fp8[0].reshape(-1, hk, d)[16:16 + sum(query_lens)].view(torch.uint8)
    result = compare(out, want, dtype)
    exact = bool(torch.equal(stored, written))
    return {**result, "ok": result["ok"] and exact, "write_exact": exact, "num_splits": plan.num_splits,
            "first_call_s": round(seconds, 3)}


def gguf_gemm_case(rows: int, n: int, k: int, qtype_name: str, dtype, device) -> dict:
    """A GGUF linear held in its blocks (gguf/triton_linear.py) against x @ W^T on gguf-py's dequantization."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants as gguf_quants

    from steploop.gpu_worker.gguf import blocks
    from steploop.gpu_worker.gguf.triton_linear import GgufBlocks
    from tests.worker.gguf_files import quantize     # gguf-py's quantize, random valid blocks for the k-quants

    qtype = T[qtype_name]
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = quantize(w, qtype)
    form = GgufBlocks.from_decoded([blocks.decode(raw, qtype, k)], torch.device(device))
    weight = torch.from_numpy(gguf_quants.dequantize(raw, qtype).reshape(n, k)).to(device)
    x = torch.randn((rows, k), generator=torch.Generator(device=device).manual_seed(1), device=device).to(dtype)
    form(x)                                              # compile
    _sync(device)
    t0 = time.perf_counter()
    got = form(x)
    _sync(device)
    seconds = time.perf_counter() - t0
    want = x.float() @ weight.T
    return {**compare(got, want, dtype, scale=float(want.abs().max()) / 4 + 1), "seconds": round(seconds, 6),
            "bits_per_weight": round(form.nbytes * 8 / (n * k), 3),
            "weight_gbs": round(form.nbytes / seconds / 1e9, 1) if seconds > 0 else None}


def cache_write_case(num_tokens, hk, d, dtype, device, num_blocks) -> dict:
    from steploop.gpu_worker.kernels.cache_write import write_kv_cache
    from steploop.gpu_worker.kernels.reference import write_kv_cache_ref

    g = torch.Generator(device=device).manual_seed(1)
    k = torch.randn((num_tokens, hk, d), generator=g, device=device).to(dtype)
    v = torch.randn((num_tokens, hk, d), generator=g, device=device).to(dtype)
    cache = torch.zeros((2, num_blocks, 16, hk, d), dtype=dtype, device=device)
    top = num_blocks * 16
    slots = torch.arange(top - num_tokens, top, device=device, dtype=torch.int64)   # the far end of the cache
    slots[::7] = -1                                                                   # padding rows: skipped
    write_kv_cache(k, v, cache, slots)
    got = cache[:, -(-num_tokens // 16) - 1:].clone()
    cache.zero_()
    write_kv_cache_ref(k, v, cache, slots)
    return {**compare(got, cache[:, -(-num_tokens // 16) - 1:], dtype), "cache_elements": cache.numel()}


def fused_cases(tokens: int, hidden: int, inter: int, h: int, hk: int, d: int, dtype, device) -> dict:
    from steploop.gpu_worker.kernels import fused, reference

    g = torch.Generator(device=device).manual_seed(2)
    x = torch.randn((tokens, hidden), generator=g, device=device).to(dtype)
    res = torch.randn((tokens, hidden), generator=g, device=device).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g, device=device)).to(dtype)
    out = {"rms_norm": compare(fused.rms_norm(x, w, 1e-6), reference.rms_norm_ref(x, w, 1e-6), dtype)}
    got, got_res = fused.rms_norm(x.clone(), w, 1e-6, res.clone())
    want, want_res = reference.fused_add_rms_norm_ref(x, res, w, 1e-6)
    out["fused_add_rms_norm"] = {"out": compare(got, want, dtype), "residual": compare(got_res, want_res, dtype)}
    gu = torch.randn((tokens, 2 * inter), generator=g, device=device).to(dtype)
    out["silu_and_mul"] = compare(fused.silu_and_mul(gu), reference.silu_and_mul_ref(gu), dtype)
    pos = torch.randint(0, 4096, (tokens,), generator=g, device=device)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=device).float() / d))
    emb = torch.outer(torch.arange(4096, device=device).float(), inv).repeat(1, 2)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q = torch.randn((tokens, h, d), generator=g, device=device).to(dtype)
    k = torch.randn((tokens, hk, d), generator=g, device=device).to(dtype)
    want_q, want_k = reference.rotary_neox_ref(pos, q, k, cos, sin)
    got_q, got_k = fused.rotary_neox(pos, q.clone(), k.clone(), cos, sin)
    out["rotary_neox"] = {"q": compare(got_q, want_q, dtype), "k": compare(got_k, want_k, dtype)}
    return out


def moe_case(tokens, hidden, inter, experts, top_k, dtype, device) -> dict:
    from steploop.gpu_worker.kernels.fused_moe import fused_experts
    from steploop.gpu_worker.kernels.reference import fused_moe_ref

    g = torch.Generator(device=device).manual_seed(3)
    x = torch.randn((tokens, hidden), generator=g, device=device).to(dtype)
    w13 = (torch.randn((experts, 2 * inter, hidden), generator=g, device=device) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn((experts, hidden, inter), generator=g, device=device) * inter ** -0.5).to(dtype)
    logits = torch.randn((tokens, experts), generator=g, device=device)
    weights, ids = logits.softmax(-1).topk(top_k, -1)
    got = fused_experts(x, w13, w2, weights, ids.to(torch.int32), "silu")
    return compare(got, fused_moe_ref(x, w13, w2, weights, ids, "silu"), dtype, scale=2.0)


def moe_ranks_case(tokens, hidden, inter, experts, top_k, ranks, dtype, device) -> dict:
    """The launches a -tp N rank makes, summed as the layer's all-reduce sums them: sharded (each rank's I / N gate,
    up rows and down columns of every expert) and expert parallel (each rank's E / N experts whole, the others'
    pairs skipped), both against the whole layer's reference."""
    from steploop.gpu_worker.kernels.fused_moe import fused_experts
    from steploop.gpu_worker.kernels.reference import fused_moe_ref

    g = torch.Generator(device=device).manual_seed(5)
    x = torch.randn((tokens, hidden), generator=g, device=device).to(dtype)
    w13 = (torch.randn((experts, 2 * inter, hidden), generator=g, device=device) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn((experts, hidden, inter), generator=g, device=device) * inter ** -0.5).to(dtype)
    weights, ids = torch.randn((tokens, experts), generator=g, device=device).softmax(-1).topk(top_k, -1)
    want = fused_moe_ref(x, w13, w2, weights, ids, "silu")
    size, held = inter // ranks, experts // ranks
    sharded = sum(fused_experts(x, torch.cat([w13[:, r * size:(r + 1) * size],
                                              w13[:, inter + r * size:inter + (r + 1) * size]], 1).contiguous(),
                                w2[:, :, r * size:(r + 1) * size].contiguous(), weights, ids, "silu").float()
                  for r in range(ranks))
    placed = sum(fused_experts(x, w13[r * held:(r + 1) * held], w2[r * held:(r + 1) * held], weights, ids, "silu",
                               first_expert=r * held).float() for r in range(ranks))
    # each rank's partial is rounded to dtype before the sum: twice the single launch's tolerance
    return {"sharded": compare(sharded.to(dtype), want, dtype, scale=4.0),
            "expert_parallel": compare(placed.to(dtype), want, dtype, scale=4.0)}


def lora_case(token_slots, hidden, n, rank, dtype, device) -> dict:
    from steploop.gpu_worker.kernels.lora_expand import lora_expand_triton
    from steploop.gpu_worker.kernels.lora_reference import lora_delta_ref, lora_shrink_ref
    from steploop.gpu_worker.kernels.lora_shrink import lora_shrink_triton
    from tests.kernels.lora_cases import make_case

    case = make_case(token_slots, hidden=hidden, n=n, rank=rank, dtype=dtype)
    on = case.to(device)
    z = lora_shrink_triton(on.x, on.lora_a, on.seg, on.scale)
    shrink = compare(z, lora_shrink_ref(case.x, case.lora_a, case.seg, case.scale).to(device), dtype)
    lora_expand_triton(on.y, z, on.lora_b, on.seg)
    want = case.y.float() + lora_delta_ref(case.x, case.lora_a, case.lora_b, case.token_slots, case.scale)
    return {"shrink": shrink, "expand": compare(on.y, want.to(device), dtype, scale=2.0)}


def tuning_case(h: int, hk: int, d: int, dtype, device, dry: bool) -> dict:
    """The start-up tuner (kernels/tuning.py) on this shape: each class's candidates timed, the fastest kept, then
    the warm-up compiles every variant; a replay of each class afterwards must compile nothing new. Under the
    interpreter (dry run) the timings mean nothing and there is no compile cache: the logic runs, that is all."""
    import tempfile

    from steploop.gpu_worker.attention.triton_backend import TritonAttentionBackend
    from steploop.gpu_worker.kernels import tuning

    backend = TritonAttentionBackend(h, hk, d, d ** -0.5)
    if not dry:                       # a windowed, soft-capped layer too (its warm-up doubles the interpreter's time)
        backend.serve_variant(1, 4096, 30.0)
    blocks = 16 if dry else 4096
    cache = torch.randn((2, blocks, 16, hk, d), device=device).to(dtype)
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "tuning.json"
        report = tuning.tune_attention(backend, cache, 16, 32768, tiny=dry, cache_path=path, reps=1 if dry else 5,
                                       max_candidates=2 if dry else None)
        warmed = tuning.warm_up_attention(backend, cache, 16)
        before = tuning.compiled_variants()
        for cls, problem in tuning.problems(16384 if dry else 32768, tiny=dry).items():   # other table widths
            tuning.make_launch(backend, problem, cache, 16, backend.launch[cls])()
        _sync(device)
        after = tuning.compiled_variants()
        again = tuning.tune_attention(backend, cache, 16, 32768, tiny=dry, cache_path=path, reps=1)
    chosen = {cls: v["config"] for cls, v in report["classes"].items()}
    return {"chosen": chosen, "timings_ms": {c: v["ms"] for c, v in report["classes"].items()},
            "tune_seconds": report["seconds"], "warmed_variants": len(warmed), "compiled_after_warm_up": before,
            "compiled_by_serving": None if before is None else after - before,
            "cached_on_second_start": again["from_cache"],
            "ok": set(chosen) == set(tuning.CLASSES) and (before is None or after == before) and again["from_cache"]}


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def cases(dry: bool) -> dict[str, Callable[[], dict]]:
    """name -> thunk. Real shapes on the GPU (bf16); a handful of tokens interpreted on the CPU (fp32)."""
    dev = "cpu" if dry else "cuda"
    dt = torch.float32 if dry else torch.bfloat16
    h, hk = (4, 2) if dry else (32, 8)
    ctx4k, ctx32k, pre = (40, 70, 24) if dry else (4096, 32768, 8192)
    # K alone over 2^31 elements (an int32 offset overflows inside one layer's K): blocks * 16 * 8 * 128 > 2^31
    # needs > 131,072 blocks; 140,000 hold 4.6e9 elements (8.5 GiB of bf16)
    big_blocks = 4 if dry else 140_000
    out: dict[str, Callable[[], dict]] = {}
    for d in ((16, 32) if dry else (64, 128)):
        out[f"decode_ctx4k_d{d}"] = lambda d=d: attention_case([1] * 4, [ctx4k] * 4, h, hk, d, dt, dev)
        out[f"decode_ctx32k_d{d}"] = lambda d=d: attention_case([1] * 2, [ctx32k, ctx32k // 3], h, hk, d, dt, dev)
        out[f"prefill_8k_d{d}"] = lambda d=d: attention_case([pre], [pre], h, hk, d, dt, dev)
        out[f"mixed_d{d}"] = lambda d=d: attention_case([1, 1, pre // 8, 3], [ctx4k, 7, pre // 8, ctx4k // 2],
                                                        h, hk, d, dt, dev)
        out[f"window_softcap_d{d}"] = lambda d=d: attention_case([1, pre // 8], [ctx4k, pre // 4], h, hk, d, dt,
                                                                 dev, window=ctx4k // 4, softcap=30.0)
        for name, kv_dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
            out[f"fp8_{name}_mixed_d{d}"] = lambda d=d, kv_dtype=kv_dtype: fp8_attention_case(
                [1, 1, pre // 8, 3], [ctx4k, 7, pre // 8, ctx4k // 2], h, hk, d, dt, dev, kv_dtype)
    for qtype in ("Q4_K", "Q6_K", "Q8_0"):             # an 8B q_proj's shape: decode and a prompt chunk
        n, k = (64, 512) if dry else (4096, 4096)
        out[f"gguf_gemm_{qtype}_decode"] = lambda q=qtype, n=n, k=k: gguf_gemm_case(1 if dry else 8, n, k, q, dt, dev)
        out[f"gguf_gemm_{qtype}_prefill"] = lambda q=qtype, n=n, k=k: gguf_gemm_case(24 if dry else 2048, n, k, q, dt,
                                                                                   dev)
    d = 32 if dry else 128
    out["decode_kv_over_2e31"] = lambda: attention_case([1, 1], [ctx4k, 33], h, hk, d, dt, dev,
                                                        extra_blocks=big_blocks, high_blocks=True)
    out["cache_write_over_2e31"] = lambda: cache_write_case(48 if dry else 4096, hk, d, dt, dev,
                                                            big_blocks + (8 if dry else 300))
    out["fused_elementwise"] = lambda: fused_cases(8 if dry else 8192, 64 if dry else 4096, 96 if dry else 14336,
                                                   h, hk, d, dt, dev)
    out["fused_moe"] = lambda: moe_case(6 if dry else 96, 32 if dry else 4096, 48 if dry else 1408,
                                        4 if dry else 8, 2, dt, dev)
    out["fused_moe_tp2_ranks"] = lambda: moe_ranks_case(6 if dry else 96, 32 if dry else 4096, 48 if dry else 1408,
                                                        4 if dry else 8, 2, 2, dt, dev)
    out["tuning"] = lambda: tuning_case(h, hk, 32 if dry else 128, dt, dev, dry)
    decode_slots, mixed_slots = [0, 1, 0, -1, 2], [0] * 20 + [-1] * 3 + [1] * 9
    out["lora_decode"] = lambda: lora_case(decode_slots * (1 if dry else 16), 32 if dry else 4096,
                                           48 if dry else 4096, 8 if dry else 16, dt, dev)
    out["lora_mixed"] = lambda: lora_case(mixed_slots * (1 if dry else 40), 32 if dry else 4096,
                                          24 if dry else 1024, 8 if dry else 64, dt, dev)
    return out


def _all_ok(value) -> bool:
    if isinstance(value, dict):
        return value.get("ok", True) and all(_all_ok(v) for v in value.values() if isinstance(v, dict))
    return True


def run(dry: bool) -> dict:
    results, failed = {}, []
    for name, thunk in cases(dry).items():
        t0 = time.perf_counter()
        try:
            results[name] = thunk()
        except Exception as exc:  # noqa: BLE001 - one failing case does not hide the others
            results[name] = {"ok": False, "error": repr(exc), "traceback": traceback.format_exc()[-1500:]}
        results[name]["seconds"] = round(time.perf_counter() - t0, 3)
        if not _all_ok(results[name]):
            failed.append(name)
        if not dry:
            torch.cuda.empty_cache()
    return {"dtype": "float32" if dry else "bfloat16", "cases": results, "failed": failed, "ok": not failed}
