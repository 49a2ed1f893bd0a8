"""What the LoRA shrink and expand launchers share: input checks against the step's segments, and the tile
choices (also used by the ahead-of-time compile test, so it compiles exactly what the launchers pick). It does not
import triton, so the CPU path (lora_ops) can use it without deciding interpreted-vs-compiled for any kernel.

Both kernels use the Punica / S-LoRA layout: the step's adapter rows are grouped into segments by slot
(services/gpu_worker/lora/segments.py) and the grid's first axis is the segment, its second the tile of BLOCK_M
rows inside the segment (programs past a segment's end do nothing), its third a tile of the output columns.
"""

from __future__ import annotations

import torch

from steploop.gpu_worker.lora.segments import LoraSegments

MAX_KERNEL_RANK = 64          # BLOCK_R covers the whole rank: 16, 32 or 64 (tl.dot needs >= 16)
SHRINK_BLOCK_K = 64           # hidden columns per step of the shrink's reduction
EXPAND_BLOCK_N = 64           # output columns per expand program
SHRINK_MAX_SPLIT_K = 8


def block_r(rank: int) -> int:
    if not 1 <= rank <= MAX_KERNEL_RANK:
        raise ValueError(f"LoRA rank {rank} is not supported by the kernels (1..{MAX_KERNEL_RANK}); "
                         f"lower --max-lora-rank or use adapters of rank <= {MAX_KERNEL_RANK}")
    return max(16, _pow2(rank))


def block_m(max_seg_len: int) -> int:
    """Rows per program: 16 for decodes (tl.dot's minimum), up to 64 for long prompt chunks."""
    return min(64, max(16, _pow2(max_seg_len)))


def shrink_split_k(max_seg_len: int, hidden: int) -> int:
    """Decode-sized segments leave few programs (segments x rank tiles), so split the hidden reduction;
    partial sums go to a [SPLIT_K, T', R] buffer summed afterwards (deterministic, no atomics)."""
    if max_seg_len > 64:
        return 1
    return max(1, min(SHRINK_MAX_SPLIT_K, hidden // (8 * SHRINK_BLOCK_K)))


def dot_constexprs(dtype: torch.dtype, interpret: bool) -> dict:
    """fp32 inputs dot in fp32 without tf32 rounding; bf16 dots are upcast under the interpreter, where
    tl.dot on bf16 operands is wrong (FACTS.md)."""
    return {"DOT_FP32": dtype == torch.float32 or (interpret and dtype == torch.bfloat16),
            "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


def interpreting() -> bool:
    import triton
    return triton.knobs.runtime.interpret


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def check_segments(seg: LoraSegments, num_rows: int, num_slots: int, device: torch.device) -> None:
    """The segments must live on the tensors' device with the dtypes the kernels read. Row and slot bounds
    (token_indices < num_rows, seg_slots < num_slots) are the caller's contract: checking them here would sync."""
    tensors = {"token_indices": (seg.token_indices, torch.int64), "seg_starts": (seg.seg_starts, torch.int32),
               "seg_lens": (seg.seg_lens, torch.int32), "seg_slots": (seg.seg_slots, torch.int32)}
    for name, (t, dtype) in tensors.items():
        if t.device != device or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"segments.{name} is {t.dtype} on {t.device}; want contiguous {dtype} on {device} "
                             "(move the step's segments once with LoraSegments.to(device))")
    if len(seg.host_segments) != seg.seg_lens.numel():
        raise ValueError(f"segments carry {len(seg.host_segments)} host segments for {seg.seg_lens.numel()} "
                         "segments; build them with build_lora_segments")
    if seg.num_tokens > num_rows or num_slots < 1:
        raise ValueError(f"segments cover {seg.num_tokens} rows of a batch of {num_rows} over {num_slots} slots")


def check_shrink(x: torch.Tensor, lora_a: torch.Tensor, scale: torch.Tensor) -> None:
    num_slots, _, hidden = lora_a.shape
    if x.dim() != 2 or x.shape[1] != hidden or scale.shape != (num_slots,):
        raise ValueError(f"shapes: x {tuple(x.shape)} [T, H], lora_a {tuple(lora_a.shape)} [L, R, H], "
                         f"scale {tuple(scale.shape)} [L]")
    if lora_a.dtype != x.dtype or scale.dtype != torch.float32:
        raise ValueError(f"dtypes: x {x.dtype}, lora_a {lora_a.dtype} (must match), scale {scale.dtype} (want fp32)")


def check_expand(y: torch.Tensor, z: torch.Tensor, lora_b: torch.Tensor, seg: LoraSegments, n_offset: int) -> None:
    _, n, rank = lora_b.shape
    if y.dim() != 2 or z.shape != (seg.num_tokens, rank) or not 0 <= n_offset <= y.shape[1] - n:
        raise ValueError(f"shapes: y {tuple(y.shape)} [T, N_total], z {tuple(z.shape)} [T', R], lora_b "
                         f"{tuple(lora_b.shape)} [L, N, R], n_offset {n_offset}, segments of {seg.num_tokens} rows")
    if lora_b.dtype != y.dtype or z.dtype not in (torch.float32, y.dtype):
        raise ValueError(f"dtypes: y {y.dtype}, lora_b {lora_b.dtype} (must match), z {z.dtype} (fp32 or y's)")


def grid(seg: LoraSegments, rows_per_program: int, col_tiles: int) -> tuple[int, int, int]:
    return (int(seg.seg_lens.numel()), -(-seg.max_seg_len // rows_per_program), col_tiles)
