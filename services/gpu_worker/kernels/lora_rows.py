"""The @triton.jit prologue the LoRA shrink and expand share: which rows of the flattened batch one program
handles (a BLOCK_M tile of one segment's rows, gathered through token_indices) and that segment's adapter slot."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def segment_rows(token_indices_ptr, seg_starts_ptr, seg_slots_ptr, seg, m_tile, seg_len, BLOCK_M: tl.constexpr):
    """-> (first row of z of the segment, slot as int64, [M] row offsets inside the segment, [M] row mask,
    [M] int64 rows of the flattened batch)."""
    seg_start = tl.load(seg_starts_ptr + seg)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < seg_len
    rows = tl.load(token_indices_ptr + seg_start + offs_m, mask=m_ok, other=0)
    return seg_start, slot, offs_m, m_ok, rows
