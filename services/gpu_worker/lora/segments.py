"""Per-step LoRA metadata: the rows of the flattened batch that use an adapter, grouped into segments by adapter.

Built once per step from each token's adapter slot and reused by every LoRA layer (shrink and expand, every
projection), in the Punica / S-LoRA style: the kernels run one group of programs per segment, each segment's rows
gathered through `token_indices`, so prompt chunks and decodes of the same adapter share one segment.

    token_slots   [ 2, -1,  0,  2,  0, -1]        (-1 = base model)
    token_indices [ 2,  4,  0,  3]                 sorted by slot, stable
    seg_slots     [ 0,  2]     seg_starts [0, 2]     seg_lens [2, 2]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraSegments:
    token_indices: torch.Tensor   # [T'] int64 rows of the flattened batch that use an adapter, sorted by slot, stable
    seg_starts: torch.Tensor      # [S] int32 offset of each segment into token_indices
    seg_lens: torch.Tensor        # [S] int32 rows in each segment (all > 0)
    seg_slots: torch.Tensor       # [S] int32 the segment's adapter slot in the stacked weights (distinct, ascending)
    max_seg_len: int              # max(seg_lens): sizes the kernels' grid
    num_tokens: int               # T' = len(token_indices)
    host_segments: tuple[tuple[int, int, int], ...] = ()   # (start, len, slot) per segment, for host-side loops

    @property
    def num_segments(self) -> int:
        return len(self.host_segments) if self.host_segments else int(self.seg_lens.numel())

    def to(self, device: torch.device | str) -> LoraSegments:
        """The same segments on another device (build on the host, move once per step)."""
        return LoraSegments(self.token_indices.to(device), self.seg_starts.to(device), self.seg_lens.to(device),
                            self.seg_slots.to(device), self.max_seg_len, self.num_tokens, self.host_segments)


def build_lora_segments(token_slots: torch.Tensor) -> LoraSegments | None:
    """token_slots [T] int (-1 = base model) -> the step's segments, or None when no token uses an adapter
    (then the step runs exactly the base path). Vectorized: one nonzero, one stable sort, one unique_consecutive.
    Syncs with the device once (for the sizes), so build it where token_slots lives on the host when possible."""
    if token_slots.dim() != 1:
        raise ValueError(f"token_slots must be 1-D [T], got shape {tuple(token_slots.shape)}")
    if token_slots.dtype.is_floating_point or token_slots.dtype == torch.bool:
        raise ValueError(f"token_slots must be an integer tensor, got {token_slots.dtype}")
    used = torch.nonzero(token_slots >= 0).squeeze(1)                  # [T'] int64, ascending
    if used.numel() == 0:
        return None
    sorted_slots, order = torch.sort(token_slots[used], stable=True)
    slots, lens = torch.unique_consecutive(sorted_slots, return_counts=True)
    starts = torch.cumsum(lens, 0) - lens
    host = tuple(zip(starts.tolist(), lens.tolist(), slots.tolist()))
    return LoraSegments(token_indices=used[order].contiguous(), seg_starts=starts.to(torch.int32),
                        seg_lens=lens.to(torch.int32), seg_slots=slots.to(torch.int32),
                        max_seg_len=max(n for _, n, _ in host), num_tokens=int(used.numel()), host_segments=host)


def pad_segments(seg: LoraSegments, tokens: torch.Tensor, segs: torch.Tensor) -> None:
    """Copy a step's segments into a CUDA graph's static ones (device to device): tokens [T] (>= seg.num_tokens)
    gets token_indices then 0; segs [3, L] gets (seg_starts, seg_lens, seg_slots) then empty segments (length 0).
    The kernels read only rows inside a segment, so the padding costs no work and changes no output."""
    n, s = seg.num_tokens, seg.seg_lens.shape[0]
    tokens[:n].copy_(seg.token_indices, non_blocking=True)
    tokens[n:].fill_(0)
    for i, part in enumerate((seg.seg_starts, seg.seg_lens, seg.seg_slots)):
        segs[i, :s].copy_(part, non_blocking=True)
    segs[:, s:].fill_(0)
