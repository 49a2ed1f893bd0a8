"""Batched LoRA for one projection of one step, on whatever device the tensors live on:

    z = lora_shrink(x, lora_a, seg, scale)          # [T', R]  scale[slot] * x[token_indices] @ A[slot]^T
    lora_expand(y, z, lora_b, seg, n_offset)        # y[token_indices, n_offset:n_offset + N] += z @ B[slot]^T
    lora_expand_slices(y, z, [b_q, b_k, b_v], seg, [0, q, q + kv])   # a fused output, each slice from its
                                                                      # columns of z (A stacked [L, sum R_i, H])

CUDA tensors run the Triton kernels (lora_shrink.py, lora_expand.py; z is fp32). CPU tensors run a torch path
that serves real traffic. The shrink gathers the adapter rows once (index_select) and runs one addmm per segment
(segments = distinct adapters in the step, at most --max-loras). The expand gathers y's adapter rows once, adds
one addmm per segment and slice into them and writes them back with one index_copy_ (index_add_ on a column
slice of y measured ~10x slower; a zeroed delta + index_add_ on whole rows no faster). z is in x's dtype, as
peft's lora_A output is. When every row uses the step's one adapter, rows are used in place. A projection costs
(slices + 1) x segments small GEMMs plus two row passes, whatever the number of tokens. The Triton modules are
imported on first CUDA use only, so the CPU path never imports triton.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from steploop.gpu_worker.kernels import lora_meta
from steploop.gpu_worker.lora.segments import LoraSegments


@contextmanager
def _one_thread() -> Iterator[None]:
    """The CPU path's ops are small (skinny GEMMs, row copies): on 2 loaded cores, splitting each over threads
    cost 5x (a gate_up's LoRA at 64 rows: 44 ms on 2 threads, 8.3 ms on 1; at 1024 rows a layer's LoRA 1490 ms vs
    258 ms), so they run on one thread (a toggle costs ~2.5 us). Process-wide, like the worker's own
    torch.set_num_threads; the model runs on one Python thread."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _whole_batch(seg: LoraSegments, num_rows: int) -> bool:
    """Every row uses the one adapter of the step: token_indices is arange(T), no gather needed."""
    return seg.num_tokens == num_rows and len(seg.host_segments) == 1


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, seg: LoraSegments, scale: torch.Tensor) -> torch.Tensor:
    """x [T, H], lora_a [L, R, H], scale [L] fp32 -> z [T', R] (fp32 on CUDA, x's dtype on the CPU)."""
    if x.is_cuda:
        from steploop.gpu_worker.kernels.lora_shrink import lora_shrink_triton
        return lora_shrink_triton(x, lora_a, seg, scale)
    lora_meta.check_shrink(x, lora_a, scale)
    lora_meta.check_segments(seg, x.shape[0], lora_a.shape[0], x.device)
    with _one_thread():
        rows = x if _whole_batch(seg, x.shape[0]) else x.index_select(0, seg.token_indices)   # [T', H]
        z = torch.empty((seg.num_tokens, lora_a.shape[1]), dtype=x.dtype)
        scales = scale.tolist()
        for start, n, slot in seg.host_segments:
            out = z[start:start + n]
            torch.addmm(out, rows[start:start + n], lora_a[slot].t(), beta=0, alpha=scales[slot], out=out)
    return z


def lora_expand(y: torch.Tensor, z: torch.Tensor, lora_b: torch.Tensor, seg: LoraSegments, n_offset: int = 0) -> None:
    """In place: y [T, N_total] columns [n_offset, n_offset + N) += z [T', R] @ lora_b [L, N, R]^T per segment."""
    lora_expand_slices(y, z, [lora_b], seg, [n_offset])


def lora_expand_slices(y: torch.Tensor, z: torch.Tensor, lora_bs: Sequence[torch.Tensor], seg: LoraSegments,
                       n_offsets: Sequence[int]) -> None:
    """In place, for each slice i: y[:, n_offsets[i]:+N_i] += z[:, sum R_<i : +R_i] @ lora_bs[i]^T per segment,
    lora_bs[i] [L, N_i, R_i]. On the CPU the rows are gathered and written back once for all slices."""
    if len(lora_bs) != len(n_offsets) or z.dim() != 2 or z.shape[1] != sum(b.shape[2] for b in lora_bs):
        raise ValueError(f"z {tuple(z.shape)} must hold the ranks of {len(lora_bs)} slices "
                         f"{[tuple(b.shape) for b in lora_bs]} at offsets {list(n_offsets)}")
    cols = [sum(b.shape[2] for b in lora_bs[:i]) for i in range(len(lora_bs))]
    if y.is_cuda:
        from steploop.gpu_worker.kernels.lora_expand import lora_expand_triton
        for b, col, offset in zip(lora_bs, cols, n_offsets):
            lora_expand_triton(y, z[:, col:col + b.shape[2]], b, seg, offset)
        return
    for b, col, offset in zip(lora_bs, cols, n_offsets):
        lora_meta.check_expand(y, z[:, col:col + b.shape[2]], b, seg, offset)
        lora_meta.check_segments(seg, y.shape[0], b.shape[0], y.device)
    with _one_thread():
        if _whole_batch(seg, y.shape[0]):
            _add_slices(y, z, lora_bs, seg, cols, n_offsets)
            return
        rows = y.index_select(0, seg.token_indices)                          # [T', N_total]
        _add_slices(rows, z, lora_bs, seg, cols, n_offsets)
        y.index_copy_(0, seg.token_indices, rows)


def _add_slices(rows: torch.Tensor, z: torch.Tensor, lora_bs: Sequence[torch.Tensor], seg: LoraSegments,
                cols: list[int], n_offsets: Sequence[int]) -> None:
    """rows [T', N_total] (the adapter rows, in segment order) += each slice's z @ B^T, one addmm per segment."""
    for b, col, offset in zip(lora_bs, cols, n_offsets):
        zs = z[:, col:col + b.shape[2]].to(b.dtype)
        out = rows.narrow(1, offset, b.shape[1])
        for start, n, slot in seg.host_segments:
            out[start:start + n].addmm_(zs[start:start + n], b[slot].t())
