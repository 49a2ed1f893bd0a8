"""Turn one StepPlan (after the persistent batch took its deltas) into the tensors of one forward pass.

For a scheduled request with c = num_computed_tokens, n scheduled tokens and d draft tokens:
    input ids  = token_ids[c : c + n - d] + drafts          positions c .. c + n - 1
    it samples iff c + n - d == len(token_ids) (it reached the end of what the worker knows); then its logits
    rows are its last d + 1 tokens. A partial prompt chunk samples nothing.

A token sampled by the step still in flight (step_overlap.py) is a placeholder in token_ids, -(1 + its row in that
step's sampled tokens): such input ids are "holes", filled on the device from that step's tokens (fill_holes).

Every array goes to the device in the step's one staged copy (staging.py); the block tables are the persistent
ones (block_table.py), gathered on the device by each request's row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from steploop.common.step_contract import StepPlan
from steploop.gpu_worker.attention.metadata import CommonAttentionMetadata
from steploop.gpu_worker.block_table import PersistentBlockTable
from steploop.gpu_worker.input_batch import InputBatch
from steploop.gpu_worker.staging import StagingBuffer, StepStaging


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
    holes: tuple[torch.Tensor, torch.Tensor] | None = None   # ([H] input positions, [H] rows of the step in flight)

    def fill_holes(self, in_flight_tokens: torch.Tensor | None) -> None:
        """Put the in-flight step's sampled tokens [S] (on the device, not yet seen by the host) into the holes."""
        if self.holes is None:
            return
        if in_flight_tokens is None:
            raise RuntimeError("the step's inputs hold tokens of a step in flight, and none is")
        where, rows = self.holes
        self.input_ids.index_copy_(0, where, in_flight_tokens.index_select(0, rows))


@dataclass
class StagedStepInputs:
    """The host half of one step's inputs: every array is in the step's staging buffer; finish() (after the one
    copy) makes the device views."""
    query_lens: np.ndarray        # [R] int32
    seq_lens: np.ndarray          # [R] int32
    max_blocks: int               # width of the step's block table
    block_size: int
    sampling: list[SamplingSlot]
    num_computed_after: dict[int, int]
    slot: dict[str, int]          # array name -> staging slot

    def finish(self, staging: StepStaging, table: PersistentBlockTable) -> StepInputs:
        def get(name: str) -> torch.Tensor:
            return staging.get(self.slot[name])

        table.apply(staging)
        block_tables = table.gather(get("rows"), self.max_blocks)           # [R, max_blocks] on the device
        query_lens, seq_lens = self.query_lens, self.seq_lens
        attn = CommonAttentionMetadata(
            num_reqs=len(query_lens), num_tokens=int(query_lens.sum()), block_size=self.block_size,
            max_query_len=int(query_lens.max(initial=0)), max_seq_len=int(seq_lens.max(initial=0)),
            query_start_loc=get("query_start_loc"), query_lens=get("query_lens"), seq_lens=get("seq_lens"),
            slot_mapping=get("slots"), block_tables=block_tables, query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
        return StepInputs(input_ids=get("input_ids"), positions=get("positions"), attn=attn,
                          logits_indices=get("logits_indices"), sampling=self.sampling,
                          num_computed_after=self.num_computed_after,
                          holes=(get("holes"), get("hole_rows")) if "holes" in self.slot else None)


def prepare_step_inputs(batch: InputBatch, plan: StepPlan, block_size: int, max_model_len: int,
                        staging: StagingBuffer) -> StepInputs:
    """The whole preparation in one call (one copy): stage, send, finish."""
    step = staging.begin()
    staged = stage_step_inputs(batch, plan, block_size, max_model_len, step)
    step.send()
    return staged.finish(step, batch.table)


def stage_step_inputs(batch: InputBatch, plan: StepPlan, block_size: int, max_model_len: int,
                      staging: StepStaging) -> StagedStepInputs:
    """Compute the step's arrays on the host and put them (and the block-table diffs) in `staging`."""
    handles, counts = plan.scheduled_handles, plan.num_scheduled_tokens
    num_reqs, num_tokens = len(handles), sum(counts)
    query_lens = np.asarray(counts, dtype=np.int32)                 # [R]
    starts = np.empty(num_reqs, dtype=np.int64)                     # [R] first position of each chunk
    max_blocks = 0
    ids: list[int] = []                     # one list, copied into the buffer once (a numpy slice per request costs)
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
            logits_rows.extend(range(len(ids) - 1 - len(drafts), len(ids)))
        else:
            after[handle] = end
    input_ids = batch.buffer("input_ids", num_tokens)
    input_ids[:] = ids
    rows = batch.table.rows(handles)                                # [R] persistent block-table rows
    positions, slots = _positions_and_slots(batch, starts, query_lens, rows, block_size, num_tokens)
    seq_lens = (starts + query_lens).astype(np.int32)
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    put = staging.put
    slot = {"input_ids": put(input_ids), "positions": put(positions), "slots": put(slots),
            "query_start_loc": put(query_start_loc), "query_lens": put(query_lens), "seq_lens": put(seq_lens),
            "rows": put(rows), "logits_indices": put(np.asarray(logits_rows, dtype=np.int64))}
    holes = np.flatnonzero(input_ids < 0)
    if holes.size:                          # tokens of the step in flight (placeholders): filled on the device
        slot["holes"], slot["hole_rows"] = put(holes.astype(np.int64)), put(-input_ids[holes] - 1)
    batch.table.stage(staging)
    return StagedStepInputs(query_lens, seq_lens, max(max_blocks, 1), block_size, sampling, after, slot)


def _positions_and_slots(batch: InputBatch, starts: np.ndarray, query_lens: np.ndarray, rows: np.ndarray,
                         block_size: int, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """positions [T] and KV slots [T], vectorized over the flat batch (blocks read from the host table)."""
    req_of_token = np.repeat(np.arange(len(query_lens)), query_lens)            # [T]
    first_token = np.cumsum(query_lens) - query_lens                            # [R]
    positions = batch.buffer("positions", num_tokens)
    np.add(starts[req_of_token], np.arange(num_tokens) - first_token[req_of_token], out=positions)
    slots = batch.buffer("slots", num_tokens)
    slots[:] = batch.table.host[rows[req_of_token], positions // block_size].astype(np.int64) * block_size \
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
