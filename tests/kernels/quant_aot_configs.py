"""The quantized-GEMM kernels' configurations for the ahead-of-time compile (tests/kernels/aot_compile.py): W4A16
for every dtype, both row blocks and the group sizes of GPTQ/AWQ/compressed-tensors int4 (per-channel = K of a
Llama-3-8B down_proj); FP8 W8A8 per-tensor and per-channel weight scales. Run as a script (not under the
interpreter):

    python -m tests.kernels.quant_aot_configs 90        # prints one line per failure, exits 1 if any
"""

from __future__ import annotations

import sys

import torch

W4A16_POINTERS = {"qweight_ptr": "*i32", "scale_ptr": "*fp32", "zero_ptr": "*fp32"}
GROUPS = (32, 64, 128, 14336)


def quant_configs(dtypes: dict, signature) -> list[tuple[str, object, dict, dict]]:
    from steploop.gpu_worker.kernels import w4a16

    out = []
    for dtype, t in dtypes.items():
        for m in (1, 512):
            for group in GROUPS:
                c = w4a16.w4a16_constexprs(m, group, dtype, interpret=False)
                out.append((f"w4a16 {t} m{c['BLOCK_M']} g{group}", w4a16.w4a16_kernel,
                            signature(w4a16.w4a16_kernel, c, t, W4A16_POINTERS), c))
    return out


if __name__ == "__main__":
    from tests.kernels.aot_compile import DTYPES, compile_all, signature
    items = quant_configs(DTYPES, signature)
    failures = compile_all(int(sys.argv[1]), items=items)
    print("\n".join(failures) or f"sm_{sys.argv[1]}: {len(items)} configurations compiled")
    sys.exit(1 if failures else 0)
