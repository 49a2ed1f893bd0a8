"""The quantized-GEMM kernels' configurations for the ahead-of-time compile (tests/kernels/aot_compile.py): W4A16
for every dtype, both row blocks and the group sizes of GPTQ/AWQ/compressed-tensors int4 (per-channel = K of a
Llama-3-8B down_proj); FP8 W8A8 for both row blocks, on sm_90 with its tensor-core e4m3 dot, on sm_80 decoded to fp16;
the GGUF GEMM for every held form (nibbles with m, int8 with and without m, 16-weight blocks) and both row blocks.
Run as a script (not under the interpreter):

    python -m tests.kernels.quant_aot_configs 90        # prints one line per failure, exits 1 if any
"""

from __future__ import annotations

import sys

W4A16_POINTERS = {"qweight_ptr": "*i32", "scale_ptr": "*fp32", "zero_ptr": "*fp32"}
FP8_POINTERS = {"xq_ptr": "*u8", "xs_ptr": "*fp32", "wq_ptr": "*u8", "ws_ptr": "*fp32"}
GROUPS = (32, 64, 128, 14336)
# GGUF held forms (gguf/triton_linear.py): (nibbles, block, has m) -> the types that decode to it
GGUF_FORMS = {(True, 32, True): "Q4_0/Q4_1/Q4_K", (False, 32, False): "Q8_0/Q5_0", (False, 32, True): "Q5_1/Q5_K",
              (False, 16, False): "Q6_K"}


def quant_configs(dtypes: dict, signature, arch: int) -> list[tuple[str, object, dict, dict]]:
    """arch: the FP8 kernel's tensor-core e4m3 path exists from sm_89 on (the launcher picks it there)."""
    from steploop.gpu_worker.kernels import fp8_w8a8, gguf_gemm, w4a16

    out = []
    for dtype, t in dtypes.items():
        for m in (1, 512):
            for group in GROUPS:
                c = w4a16.w4a16_constexprs(m, group, dtype, interpret=False)
                out.append((f"w4a16 {t} m{c['BLOCK_M']} g{group}", w4a16.w4a16_kernel,
                            signature(w4a16.w4a16_kernel, c, t, W4A16_POINTERS), c))
            c = fp8_w8a8.fp8_constexprs(m, native_fp8=arch >= 89, interpret=False)
            out.append((f"fp8_w8a8 {t} m{c['BLOCK_M']} native={c['NATIVE_FP8']}", fp8_w8a8.fp8_w8a8_kernel,
                        signature(fp8_w8a8.fp8_w8a8_kernel, c, t, FP8_POINTERS), c))
            for (nibbles, block, has_m), types in GGUF_FORMS.items():
                c = gguf_gemm.gguf_gemm_constexprs(m, block, nibbles, has_m, dtype, interpret=False)
                ptrs = {"q_ptr": "*u8" if nibbles else "*i8", "d_ptr": "*fp32", "m_ptr": "*fp32"}
                out.append((f"gguf_gemm {types} {t} m{c['BLOCK_M']}", gguf_gemm.gguf_gemm_kernel,
                            signature(gguf_gemm.gguf_gemm_kernel, c, t, ptrs), c))
    return out


if __name__ == "__main__":
    from tests.kernels.aot_compile import DTYPES, compile_all, signature
    items = quant_configs(DTYPES, signature, int(sys.argv[1]))
    failures = compile_all(int(sys.argv[1]), items=items)
    print("\n".join(failures) or f"sm_{sys.argv[1]}: {len(items)} configurations compiled")
    sys.exit(1 if failures else 0)
