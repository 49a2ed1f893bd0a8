"""Compile every kernel ahead of time for one GPU architecture, with the constexpr configurations the launchers
pick for real models (no GPU needed: triton.compile + GPUTarget). Run as a script (not under the interpreter):

    python -m tests.kernels.aot_compile 90        # prints one line per failure, exits 1 if any
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
MODEL_SHAPES = [(9, 3, 64), (32, 8, 128)]   # (heads, kv heads, head dim): SmolLM2-135M, Llama-3-8B
INT_POINTERS = {"block_table_ptr", "seq_lens_ptr", "query_start_loc_ptr", "tile_req_ptr", "tile_qstart_ptr",
                "sorted_ids_ptr", "block_expert_ptr", "num_padded_ptr"}
FLOATS = {"scale", "eps", "softcap"}
# per-layer attention variants (window, softcap): Mistral's window, Gemma 2's local layers with its cap, and
# Gemma 2's global layers (cap only)
VARIANTS = {"window": (4096, None), "window+softcap": (4096, 50.0), "softcap": (None, 50.0)}


def signature(kernel, constexprs: dict, dtype: str, pointers: dict[str, str] | None = None) -> dict:
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = (pointers or {}).get(name) or ("*i32" if name in INT_POINTERS else f"*{dtype}")
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    return sig


def configs() -> list[tuple[str, object, dict, dict]]:
    """(label, kernel, signature, constexprs) for every configuration a launcher can pick."""
    from steploop.gpu_worker.kernels import cache_write, fused
    from steploop.gpu_worker.kernels import paged_attention as pa

    out = []
    for dtype, t in DTYPES.items():
        for h, hk, d in MODEL_SHAPES:
            modes = {"decode": (pa.choose_block_q(h // hk, 1), 1), "decode-split": (pa.choose_block_q(h // hk, 1), 8),
                     "prefill": (pa.choose_block_q(h // hk, 512), 1)}
            for mode, (block_q, splits) in modes.items():
                c = pa.attention_constexprs(h, hk, d, 16, block_q, splits, dtype, interpret=False)
                ptrs = {n: "*fp32" for n in ("part_acc_ptr", "part_m_ptr", "part_l_ptr", "k_scale_ptr", "v_scale_ptr")}
                out.append((f"attention {mode} {t} h{h}/{hk} d{d}", pa.unified_attention_kernel,
                            signature(pa.unified_attention_kernel, c, t, ptrs), c))
            if dtype != torch.float32:        # an FP8 cache (--kv-cache-dtype) under 16-bit models: its bytes
                for kv_fp8, fmt in ((1, "e4m3"), (2, "e5m2")):
                    for mode, (block_q, splits) in modes.items():
                        c = pa.attention_constexprs(h, hk, d, 16, block_q, splits, dtype, False, kv_fp8=kv_fp8)
                        ptrs = {n: "*fp32" for n in ("part_acc_ptr", "part_m_ptr", "part_l_ptr", "k_scale_ptr",
                                                     "v_scale_ptr")}
                        ptrs.update(k_cache_ptr="*u8", v_cache_ptr="*u8")
                        out.append((f"attention {mode} kv {fmt} {t} h{h}/{hk} d{d}", pa.unified_attention_kernel,
                                    signature(pa.unified_attention_kernel, c, t, ptrs), c))
                c = cache_write.cache_write_constexprs(hk, d, 16)
                out.append((f"cache_write fp8 bytes hk{hk} d{d}", cache_write.cache_write_kernel,
                            signature(cache_write.cache_write_kernel, c, "u8", {"slot_mapping_ptr": "*i64"}), c))
            for variant, (window, softcap) in VARIANTS.items():
                for mode, (block_q, splits) in modes.items():
                    c = pa.attention_constexprs(h, hk, d, 16, block_q, splits, dtype, False, window, softcap)
                    ptrs = {n: "*fp32" for n in ("part_acc_ptr", "part_m_ptr", "part_l_ptr", "k_scale_ptr",
                                                 "v_scale_ptr")}
                    out.append((f"attention {mode} {variant} {t} h{h}/{hk} d{d}", pa.unified_attention_kernel,
                                signature(pa.unified_attention_kernel, c, t, ptrs), c))
            for splits in (2, 16):
                c = {"HEAD_DIM": d, "HEAD_DIM_P": d, "NUM_SPLITS": splits}
                ptrs = {n: "*fp32" for n in ("part_acc_ptr", "part_m_ptr", "part_l_ptr")}
                out.append((f"reduce {t} d{d} s{splits}", pa.reduce_splits_kernel,
                            signature(pa.reduce_splits_kernel, c, t, ptrs), c))
            c = cache_write.cache_write_constexprs(hk, d, 16)
            out.append((f"cache_write {t} hk{hk} d{d}", cache_write.cache_write_kernel,
                        signature(cache_write.cache_write_kernel, c, t, {"slot_mapping_ptr": "*i64"}), c))
            c = {"NUM_HEADS": h, "NUM_KV_HEADS": hk, "HEADS_P": 1 << (h - 1).bit_length(), "HALF": d // 2, "HALF_P": d // 2}
            out.append((f"rotary {t} h{h}/{hk} d{d}", fused.rotary_neox_kernel,
                        signature(fused.rotary_neox_kernel, c, t, {"positions_ptr": "*i64"}), c))
        out += moe_configs(dtype, t)
        if dtype == torch.bfloat16:
            out += tuning_configs(t)
        for hidden, inter in ((576, 1536), (4096, 14336)):
            for residual in (False, True):
                c = {"N": hidden, "BLOCK": 1 << (hidden - 1).bit_length(), "HAS_RESIDUAL": residual}
                out.append((f"rms_norm {t} {hidden} residual={residual}", fused.rms_norm_kernel,
                            signature(fused.rms_norm_kernel, c, t), c))
            c = {"I": inter, "BLOCK": min(fused.SILU_BLOCK, 1 << (inter - 1).bit_length())}
            out.append((f"silu_and_mul {t} {inter}", fused.silu_and_mul_kernel,
                        signature(fused.silu_and_mul_kernel, c, t), c))
    return out


def tuning_configs(t: str) -> list[tuple]:
    """Every num_warps / num_stages candidate the start-up tuner may pick (kernels/tuning.py), per shape class, on
    the 8B shape: a candidate that does not compile would fail the tuning on the GPU."""
    from steploop.gpu_worker.kernels import paged_attention as pa
    from steploop.gpu_worker.kernels.tuning import CANDIDATES

    h, hk, d = MODEL_SHAPES[-1]
    modes = {"decode": (pa.choose_block_q(h // hk, 1), 1), "split": (pa.choose_block_q(h // hk, 1), 8),
             "mixed": (pa.choose_block_q(h // hk, 512), 1)}
    out = []
    for cls, (block_q, splits) in modes.items():
        for cand in CANDIDATES[cls]:
            c = pa.attention_constexprs(h, hk, d, 16, block_q, splits, torch.bfloat16, interpret=False)
            ptrs = {n: "*fp32" for n in ("part_acc_ptr", "part_m_ptr", "part_l_ptr", "k_scale_ptr", "v_scale_ptr")}
            out.append((f"attention {cls} {t} w{cand.num_warps} s{cand.num_stages}", pa.unified_attention_kernel,
                        signature(pa.unified_attention_kernel, c, t, ptrs), c,
                        {"num_warps": cand.num_warps, "num_stages": cand.num_stages}))
    return out


def moe_configs(dtype: torch.dtype, t: str) -> list[tuple[str, object, dict, dict]]:
    """The fused-MoE launches: both row blocks; the GLU up projection per activation, the routed down projection
    (the shapes are runtime arguments, so these cover every model)."""
    from steploop.gpu_worker.kernels import fused_moe as fm

    out = []
    for block_m in (fm.choose_block_m(2, 8), fm.choose_block_m(4096, 8)):
        launches = [(f"w13 {act}", 2, True, act, False) for act in fm.ACTIVATIONS] + [("w2", 1, False, "", True)]
        for label, top_k, glu, act, routed in launches:
            c = fm.moe_constexprs(top_k, glu, act, routed, block_m, dtype, interpret=False)
            out.append((f"fused_moe {label} {t} m{block_m}", fm.fused_moe_kernel,
                        signature(fm.fused_moe_kernel, c, t, {"topk_weights_ptr": "*fp32"}), c))
    return out


def compile_all(arch: int, workers: int = 1, items: list | None = None) -> list[str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)

    def one(item) -> str | None:
        label, kernel, sig, consts = item[:4]
        options = item[4] if len(item) > 4 else None
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=target,
                                      options=options)
            assert compiled.asm.get("cubin"), "no cubin"
        except Exception as exc:  # noqa: BLE001 - report every failing configuration
            return f"sm_{arch} {label}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        return None

    with ThreadPoolExecutor(workers) as pool:
        return [f for f in pool.map(one, configs() if items is None else items) if f]


def compile_in_subprocesses(module: str, archs=(80, 90), timeout: float = 600) -> dict[int, str]:
    """Run `python -m module ARCH` for each architecture in parallel, outside the interpreter (the calling pytest
    process has TRITON_INTERPRET=1); -> {arch: output} of the ones that failed."""
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    procs = {arch: subprocess.Popen([sys.executable, "-m", module, str(arch)], cwd=root, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for arch in archs}
    outputs = {arch: p.communicate(timeout=timeout)[0] for arch, p in procs.items()}
    return {arch: out for arch, out in outputs.items() if procs[arch].returncode}


if __name__ == "__main__":
    failures = compile_all(int(sys.argv[1]))
    print("\n".join(failures) or f"sm_{sys.argv[1]}: {len(configs())} configurations compiled")
    sys.exit(1 if failures else 0)
