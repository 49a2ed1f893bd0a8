"""The torch backend's CPU decode attention, three ways side by side in one run.

    python -m benchmarks.torch_decode_attention

64 decode requests x 256 context tokens, SmolLM2's shapes (9 query heads, 3 KV heads, head size 64, 30 layers):
  advanced_index_sdpa: advanced indexing on dim 1 of the [2, blocks, bs, Hk, D] cache + SDPA with a mask
  index_select_sdpa:   index_select per K and V on the contiguous cache + the same SDPA (the fallback path)
  c_kernel:            the fused C paged kernel (services/gpu_worker/cpu_kernels), reading the cache in place
Each timed call runs all 30 layers, each on its own cache (25 MB each, so no layer's K/V is still in the CPU's
cache when it comes round again, as in serving); the figures are per layer. Variants are timed round-robin, so
load from other processes on the machine hits them alike. Writes benchmarks/results/torch_decode_attention.json.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import time

import torch
import torch.nn.functional as F

from steploop.gpu_worker.cpu_kernels import paged_attention as cpu_pa

RESULTS = pathlib.Path(__file__).parent / "results" / "torch_decode_attention.json"
G, CTX, BS, H, HK, D, LAYERS = 64, 256, 16, 9, 3, 64, 30


def main(reps: int = 15) -> None:
    torch.manual_seed(0)
    nb = CTX // BS
    caches = [torch.randn(2, G * nb + 1, BS, HK, D) for _ in range(LAYERS)]
    tables = torch.randperm(G * nb)[: G * nb].view(G, nb) + 1
    q = torch.randn(G, H, 1, D)
    mask = torch.ones(G, 1, 1, CTX, dtype=torch.bool)
    flat = tables.reshape(-1)
    q3, out = q.view(G, H, D).contiguous(), torch.empty(G, H, D)
    tables32, seq_lens = tables.int(), torch.full((G,), CTX, dtype=torch.int32)
    query_start_loc = torch.arange(G + 1, dtype=torch.int32)
    threads = torch.get_num_threads()

    def advanced_index_sdpa(cache):
        kv = cache[:, tables].view(2, G, -1, HK, D).transpose(2, 3)
        return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, scale=D ** -0.5, enable_gqa=True)

    def index_select_sdpa(cache):
        k, v = (cache[i].index_select(0, flat).view(G, -1, HK, D).transpose(1, 2) for i in (0, 1))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D ** -0.5, enable_gqa=True)

    def c_kernel(cache):
        cpu_pa.paged_attention(out, q3, cache, tables32, query_start_loc, seq_lens, D ** -0.5, threads)
        return out

    variants = {"advanced_index_sdpa": advanced_index_sdpa, "index_select_sdpa": index_select_sdpa}
    if cpu_pa.available():
        variants["c_kernel"] = c_kernel
        torch.testing.assert_close(c_kernel(caches[0]).clone(), index_select_sdpa(caches[0]).view(G, H, D),
                                   atol=1e-5, rtol=0)
    assert torch.allclose(advanced_index_sdpa(caches[0]), index_select_sdpa(caches[0]), atol=1e-5)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(reps + 1):
        for name, fn in variants.items():
            start = time.perf_counter()
            for cache in caches:
                fn(cache)
            if rep:                                                   # rep 0 warms up
                samples[name].append((time.perf_counter() - start) / LAYERS)
    ms = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
    result = {"shape": {"requests": G, "context": CTX, "heads": H, "kv_heads": HK, "head_dim": D, "layers": LAYERS},
              "threads": threads, "ms_per_layer": ms,
              "index_select_vs_advanced_index": ms["advanced_index_sdpa"] / ms["index_select_sdpa"]}
    if "c_kernel" in ms:
        result["c_kernel_speedup_vs_index_select_sdpa"] = ms["index_select_sdpa"] / ms["c_kernel"]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
