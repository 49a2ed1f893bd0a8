"""The LoRA kernels' configurations for the ahead-of-time compile (tests/kernels/aot_compile.py): every dtype and
rank tile, for decodes (BLOCK_M 16, split hidden reduction on wide models) and prompt chunks (BLOCK_M 64), exactly
as the launchers' constexpr functions pick them. A set of its own (test_lora_compile.py) so the two compile tests
each stay well inside their time limit on a loaded machine. Run as a script (not under the interpreter):

    python -m tests.kernels.lora_aot_configs 90        # prints one line per failure, exits 1 if any
"""

from __future__ import annotations

import sys

LORA_RANKS = (8, 16, 32, 64)
LORA_SHAPES = ((1, 576), (1, 4096), (512, 4096))   # (max segment length, hidden): decode small/wide, prompt chunk
LORA_POINTERS = {"scale_ptr": "*fp32", "z_ptr": "*fp32", "token_indices_ptr": "*i64", "seg_starts_ptr": "*i32",
                 "seg_lens_ptr": "*i32", "seg_slots_ptr": "*i32"}


def lora_configs(dtypes: dict, signature) -> list[tuple[str, object, dict, dict]]:
    from steploop.gpu_worker.kernels import lora_expand, lora_shrink

    out, seen = [], set()
    for dtype, t in dtypes.items():
        for rank in LORA_RANKS:
            for max_seg_len, hidden in LORA_SHAPES:
                for name, kernel, c in (
                        ("lora_shrink", lora_shrink.lora_shrink_kernel,
                         lora_shrink.shrink_constexprs(max_seg_len, hidden, rank, dtype, interpret=False)),
                        ("lora_expand", lora_expand.lora_expand_kernel,
                         lora_expand.expand_constexprs(max_seg_len, rank, dtype, interpret=False))):
                    key = (name, t, tuple(sorted(c.items())))
                    if key not in seen:
                        seen.add(key)
                        label = f"{name} {t} " + " ".join(f"{k}={v}" for k, v in c.items() if k.isupper())
                        out.append((label, kernel, signature(kernel, c, t, LORA_POINTERS), c))
    return out


if __name__ == "__main__":
    from tests.kernels.aot_compile import DTYPES, compile_all, signature

    items = lora_configs(DTYPES, signature)
    failures = compile_all(int(sys.argv[1]), items=items)
    print("\n".join(failures) or f"sm_{sys.argv[1]}: {len(items)} LoRA configurations compiled")
    sys.exit(1 if failures else 0)
