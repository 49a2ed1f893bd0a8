"""Turn one StepPlan (after the persistent batch took its deltas) into the tensors of one forward pass.

For a scheduled request with c = num_computed_tokens, n scheduled tokens and d draft tokens:
    input ids  = token_ids[c : c + n - d] + drafts          positions c .. c + n - 1
    it samples iff c + n - d == len(token_ids) (it reached the end of what the worker knows); then its logits
    rows are its last d + 1 tokens. A partial prompt chunk samples nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from steploop.common.step_contract import StepPlan
from steploop.gpu_worker.attention.metadata import (
    CommonAttentionMetadata,
    build_common_metadata,
)
from steploop.gpu_worker.input_batch import InputBatch


@dataclass
class SamplingSlot:
    handle: int
    first_row: int                # its first row in logits (rows first_row .. first_row + len(drafts))
    drafts: list[int]             # [d] draft tokens to verify
    num_known_end: int            # c + n - d: tokens with KV once this step ran (before accepting drafts)


@dataclass
class StepInputs:
    input_ids: torch.Tensor       # [T] int64
    positions: torch.Tensor       # [T] int64
    attn: CommonAttentionMetadata
    logits_indices: torch.Tensor  # [S] int64 rows of the flat batch that need logits
    sampling: list[SamplingSlot]  # requests that sample, in logits-row order
    num_computed_after: dict[int, int]   # handle -> num_computed_tokens after this step (non-sampling ones)


def prepare_step_inputs(batch: InputBatch, plan: StepPlan, block_size: int, max_model_len: int,
                        device: torch.device) -> StepInputs:
    handles, counts = plan.scheduled_handles, plan.num_scheduled_tokens
    num_reqs, num_tokens = len(handles), sum(counts)
    query_lens = np.asarray(counts, dtype=np.int32)                 # [R]
    starts = np.empty(num_reqs, dtype=np.int64)                     # [R] first position of each chunk
    max_blocks = 0
    ids: list[int] = []
    sampling: list[SamplingSlot] = []
    after: dict[int, int] = {}
    logits_rows: list[int] = []
    for i, (handle, n) in enumerate(zip(handles, counts)):
        state, drafts = batch[handle], plan.draft_token_ids.get(handle, [])
        c, end = state.num_computed_tokens, state.num_computed_tokens + n - len(drafts)
        _check_request(handle, n, drafts, end, state.num_tokens, len(state.block_ids), block_size,
                       c + n, max_model_len)
        starts[i] = c
        ids.extend(state.token_ids[c:end])
        ids.extend(drafts)
        max_blocks = max(max_blocks, len(state.block_ids))
        if end == state.num_tokens:
            sampling.append(SamplingSlot(handle, len(logits_rows), list(drafts), end))
            last = len(ids) - 1
            logits_rows.extend(range(last - len(drafts), last + 1))
        else:
            after[handle] = end
    block_tables = np.zeros((num_reqs, max(max_blocks, 1)), dtype=np.int32)   # [R, max_blocks], 0 = null
    for i, handle in enumerate(handles):
        blocks = batch[handle].block_ids
        block_tables[i, :len(blocks)] = blocks
    positions, slots = _positions_and_slots(batch, starts, query_lens, block_tables, block_size, num_tokens)
    seq_lens = (starts + query_lens).astype(np.int32)
    input_ids = batch.buffer("input_ids", num_tokens)
    input_ids[:] = ids
    return StepInputs(
        input_ids=torch.from_numpy(input_ids).to(device), positions=torch.from_numpy(positions).to(device),
        attn=build_common_metadata(query_lens, seq_lens, block_tables, slots, block_size, device),
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=device), sampling=sampling,
        num_computed_after=after)


def _positions_and_slots(batch: InputBatch, starts: np.ndarray, query_lens: np.ndarray, block_tables: np.ndarray,
                         block_size: int, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """positions [T] and KV slots [T], vectorized over the flat batch."""
    req_of_token = np.repeat(np.arange(len(query_lens)), query_lens)            # [T]
    first_token = np.cumsum(query_lens) - query_lens                            # [R]
    positions = batch.buffer("positions", num_tokens)
    np.add(starts[req_of_token], np.arange(num_tokens) - first_token[req_of_token], out=positions)
    slots = batch.buffer("slots", num_tokens)
    slots[:] = block_tables[req_of_token, positions // block_size].astype(np.int64) * block_size \
        + positions % block_size
    return positions, slots


def _check_request(handle: int, n: int, drafts: list[int], end: int, num_tokens: int, num_blocks: int,
                   block_size: int, seq_len: int, max_model_len: int) -> None:
    if n <= len(drafts):
        raise ValueError(f"handle {handle}: {n} scheduled tokens cannot hold {len(drafts)} drafts plus one")
    if end > num_tokens:
        raise ValueError(f"handle {handle}: scheduled up to token {end}, the worker knows {num_tokens}")
    if drafts and end != num_tokens:
        raise ValueError(f"handle {handle}: drafts scheduled before the end of its known tokens")
    if seq_len > max_model_len:
        raise ValueError(f"handle {handle}: {seq_len} tokens exceed max_model_len {max_model_len}")
    if -(-seq_len // block_size) > num_blocks:
        raise ValueError(f"handle {handle}: {seq_len} tokens need {-(-seq_len // block_size)} blocks, "
                         f"its block table has {num_blocks}")
