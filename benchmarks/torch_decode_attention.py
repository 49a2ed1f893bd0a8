"""The torch backend's decode attention, before and after the gather change, side by side in one run.

    python -m benchmarks.torch_decode_attention

64 decode requests x 256 context tokens, SmolLM2's shapes (9 query heads, 3 KV heads, head size 64), one layer:
  before: advanced indexing on dim 1 of the [2, blocks, bs, Hk, D] cache + SDPA with a mask
  after:  index_select per K and V on the contiguous cache + the same SDPA (what the backend does now)
Writes benchmarks/results/torch_decode_attention.json.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import time

import torch
import torch.nn.functional as F

RESULTS = pathlib.Path(__file__).parent / "results" / "torch_decode_attention.json"
G, CTX, BS, H, HK, D = 64, 256, 16, 9, 3, 64


def _time(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def main() -> None:
    torch.manual_seed(0)
    nb = CTX // BS
    cache = torch.randn(2, G * nb + 1, BS, HK, D)
    tables = torch.randperm(G * nb)[: G * nb].view(G, nb) + 1
    q = torch.randn(G, H, 1, D)
    mask = torch.ones(G, 1, 1, CTX, dtype=torch.bool)
    flat = tables.reshape(-1)

    def before():
        kv = cache[:, tables].view(2, G, -1, HK, D).transpose(2, 3)
        return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, scale=D ** -0.5, enable_gqa=True)

    def after():
        k, v = (cache[i].index_select(0, flat).view(G, -1, HK, D).transpose(1, 2) for i in (0, 1))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D ** -0.5, enable_gqa=True)

    assert torch.allclose(before(), after(), atol=1e-5)
    t_before, t_after = _time(before), _time(after)
    result = {"shape": {"requests": G, "context": CTX, "heads": H, "kv_heads": HK, "head_dim": D},
              "threads": torch.get_num_threads(), "before_ms_per_layer": t_before * 1e3,
              "after_ms_per_layer": t_after * 1e3, "speedup": t_before / t_after}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
