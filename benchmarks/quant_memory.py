"""Weights in memory per quantized format, against the same weights in fp32 and as stored in the file: one decoder
layer of a Llama-3.2-1B shape (hidden 2048, 32/8 heads of 64, MLP 8192), quantized by the test writer
(tests/worker/quant_models.py), read and packed by the worker's code (model/quant/), and one 32-row matmul timed
against torch fp32 on the dequantized weights (the same arithmetic: a CPU figure, not a test).

    PYTHONPATH=. python benchmarks/quant_memory.py        # prints a table, writes benchmarks/results/quant_memory.json
"""

from __future__ import annotations

import json
import pathlib
import time

import torch

from benchmarks.machine import machine_info
from steploop.gpu_worker.cpu_kernels import packed_linear as kernel
from steploop.gpu_worker.model.quant.config import read_quant_config
from steploop.gpu_worker.model.quant.formats import dequantize, read_linear
from steploop.gpu_worker.model.quant.linear import QuantLinear
from tests.worker.quant_models import WRITERS, Spec, quantization_config

HIDDEN, Q, KV, INTER = 2048, 2048, 512, 8192
LAYER = {"qkv": (HIDDEN, (Q, KV, KV)), "o": (Q, (HIDDEN,)), "gate_up": (HIDDEN, (INTER, INTER)), "down": (INTER, (HIDDEN,))}
SPECS = [Spec("gptq", 4, 128, True), Spec("gptq", 4, 128, False, desc_act=True), Spec("gptq", 8, 128, True),
         Spec("awq", 4, 128, False), Spec("ct_int", 4, 128, True), Spec("ct_int", 8, -1, True), Spec("ct_fp8"),
         Spec("ct_fp8", fp8_channel=True)]


def _timed(fn, reps: int = 5) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def measure(spec: Spec) -> dict:
    scheme = read_quant_config(quantization_config(spec))
    gen = torch.Generator().manual_seed(0)
    held = stored = fp32 = 0
    quant_s = torch_s = 0.0
    for name, (k, rows) in LAYER.items():
        layer = QuantLinear(k, sum(rows), False, [f"{name}{i}" for i in range(len(rows))])
        dense = []
        for i, n in enumerate(rows):
            tensors = WRITERS[spec.method](torch.randn(n, k, generator=gen) * 0.02, spec, gen)
            stored += sum(t.numel() * t.element_size() for t in tensors.values())
            layer.loaded[f"{name}{i}"] = read_linear(scheme, name, tensors, n, k)
            dense.append(dequantize(layer.loaded[f"{name}{i}"]))
        layer.finish(torch.device("cpu"), kernel.available())
        weight = torch.cat(dense)
        del dense
        held, fp32 = held + layer.nbytes, fp32 + weight.numel() * 4
        x = torch.randn(32, k)
        quant_s += _timed(lambda layer=layer, x=x: layer(x))
        torch_s += _timed(lambda x=x, weight=weight: x @ weight.T)
    return {"format": spec.id, "scheme": scheme.describe(), "in_memory_bytes": held, "stored_bytes": stored,
            "fp32_bytes": fp32, "in_memory_vs_fp32": round(held / fp32, 4),
            "matmul_32_rows_ms": round(quant_s * 1e3, 2), "torch_fp32_ms": round(torch_s * 1e3, 2)}


def main() -> None:
    torch.manual_seed(0)
    rows = [measure(spec) for spec in SPECS]
    print(f"{'format':28} {'in memory':>12} {'stored':>12} {'fp32':>12} {'ratio':>7} {'ms/32 rows':>10} {'torch fp32':>10}")
    for r in rows:
        print(f"{r['format']:28} {r['in_memory_bytes']:12,} {r['stored_bytes']:12,} {r['fp32_bytes']:12,} "
              f"{r['in_memory_vs_fp32']:7.3f} {r['matmul_32_rows_ms']:10.2f} {r['torch_fp32_ms']:10.2f}")
    out = pathlib.Path(__file__).parent / "results" / "quant_memory.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), "threads": torch.get_num_threads(), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
