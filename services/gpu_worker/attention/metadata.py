"""Per-step attention metadata: built once per step from the batch, then read by every layer.

The step's tokens are one flat batch, grouped by request in batch order:

    tokens:           | r0 chunk (5) | r1 decode (1) | r2 chunk (3) |
    query_start_loc:  0              5               6              9
    seq_lens:         r0: cached + 5, r1: cached + 1, r2: cached + 3   (context including the new tokens)

A token at position p of request r lives in KV slot block_tables[r, p // block_size] * block_size
+ p % block_size; slot_mapping holds that slot for every token of the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class CommonAttentionMetadata:
    num_reqs: int
    num_tokens: int
    block_size: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor   # [num_reqs + 1] int32 on device: start of each request's tokens
    query_lens: torch.Tensor        # [num_reqs] int32 on device: new tokens per request
    seq_lens: torch.Tensor          # [num_reqs] int32 on device: context length incl. the new tokens
    slot_mapping: torch.Tensor      # [num_tokens] int64 on device: KV slot each new token is written to
    block_tables: torch.Tensor      # [num_reqs, max_blocks] int32 on device, padded with block 0 (null)
    query_lens_cpu: np.ndarray      # [num_reqs] int32 host copy (for backends that plan on the host)
    seq_lens_cpu: np.ndarray        # [num_reqs] int32 host copy


def build_common_metadata(query_lens: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
                          slot_mapping: np.ndarray, block_size: int,
                          device: torch.device) -> CommonAttentionMetadata:
    """query_lens/seq_lens [num_reqs], block_tables [num_reqs, max_blocks], slot_mapping [num_tokens]."""
    query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])

    def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(a).to(device=device, dtype=dtype, non_blocking=True)

    return CommonAttentionMetadata(
        num_reqs=len(query_lens), num_tokens=int(query_start_loc[-1]), block_size=block_size,
        max_query_len=int(query_lens.max(initial=0)), max_seq_len=int(seq_lens.max(initial=0)),
        query_start_loc=dev(query_start_loc, torch.int32), query_lens=dev(query_lens, torch.int32),
        seq_lens=dev(seq_lens, torch.int32), slot_mapping=dev(slot_mapping, torch.int64),
        block_tables=dev(block_tables, torch.int32), query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
