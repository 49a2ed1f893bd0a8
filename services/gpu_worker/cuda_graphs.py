"""CUDA graphs for whole steps: decode-only, mixed prefill + decode, each with or without LoRA (capture_plan.py).

The unified attention kernel serves any mix of chunks and decodes in one launch, so a whole step can be one graph:
its grid is (query tiles, KV heads, splits), and a graph captured for T tokens / R requests / N tiles serves every
step that fits them, padded (see capture_plan.py for what padding holds). Static buffers, sized for the largest
graph, carry everything a replay reads; a replay copies the step's device tensors into them (device to device; the
step's one host copy already happened) and replays:

    input_ids, positions, slot_mapping [T]      the step's, then slot -1 (the cache write skips them)
    query_start_loc [R + 2], seq_lens [R + 1]   the step's, then zero-length requests; request R is the spare
    block_tables [R + 1, max_blocks]            the step's rows (width <= static)
    tile_req, tile_qstart [N]                   the step's tiles, then tiles of the spare request (no work)
    logits_indices [T]                          the step's rows, then row 0 (discarded)
    LoRA segments                               the step's, then empty segments (lora/segments.py: pad_segments)

capture=False (CPU tests) runs the same padding and static metadata eagerly, so "graph == eager" is checked on
the CPU under the Triton interpreter; only the capture itself needs a GPU. With LoRA, capture=False arms the hooks
with the step's own segments (the CPU LoRA path loops over host segments); the padded segments are checked
against the kernels in tests/kernels.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from steploop.gpu_worker.attention.metadata import CommonAttentionMetadata
from steploop.gpu_worker.capture_plan import CapturePlan, GraphKey, GraphShape
from steploop.gpu_worker.kernels.launch_config import DEFAULT as DEFAULT_LAUNCH
from steploop.gpu_worker.kernels.launch_config import shape_class
from steploop.gpu_worker.lora.segments import LoraSegments, pad_segments

if TYPE_CHECKING:      # the kernels import triton: only the CUDA path (and its tests) load them
    from steploop.gpu_worker.kernels.paged_attention import AttentionPlan

log = logging.getLogger(__name__)


@dataclass
class StaticBuffers:
    """Inputs of the largest graph; a graph of T tokens / R requests / N tiles uses the leading part."""
    input_ids: torch.Tensor        # [T_max] int64
    positions: torch.Tensor        # [T_max] int64
    slot_mapping: torch.Tensor     # [T_max] int64, -1 = no KV write
    query_start_loc: torch.Tensor  # [R_max + 2] int32
    query_lens: torch.Tensor       # [R_max + 1] int32 (not read by the triton backend; kept for the interface)
    seq_lens: torch.Tensor         # [R_max + 1] int32
    block_tables: torch.Tensor     # [R_max + 1, max_blocks] int32
    tile_req: torch.Tensor         # [N_max] int32
    tile_qstart: torch.Tensor      # [N_max] int32
    logits_indices: torch.Tensor   # [T_max] int64
    lora_tokens: torch.Tensor      # [T_max] int64 LoRA token_indices
    lora_segs: torch.Tensor        # [3, max_loras] int32: seg_starts, seg_lens, seg_slots

    @classmethod
    def allocate(cls, shapes: list[GraphShape], max_blocks: int, max_loras: int,
                 device: torch.device) -> StaticBuffers:
        t = max(s.key.tokens for s in shapes)
        r = max(s.max_reqs for s in shapes)
        n = max(s.max_tiles for s in shapes)

        def z(*shape, dtype=torch.int32):
            return torch.zeros(shape, dtype=dtype, device=device)
        return cls(input_ids=z(t, dtype=torch.int64), positions=z(t, dtype=torch.int64),
                   slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=device),
                   query_start_loc=z(r + 2), query_lens=z(r + 1), seq_lens=z(r + 1),
                   block_tables=z(r + 1, max_blocks), tile_req=z(n), tile_qstart=z(n),
                   logits_indices=z(t, dtype=torch.int64), lora_tokens=z(t, dtype=torch.int64),
                   lora_segs=z(3, max(max_loras, 1)))

    def common(self, shape: GraphShape, block_size: int, max_seq_len: int) -> CommonAttentionMetadata:
        t, r = shape.key.tokens, shape.max_reqs
        return CommonAttentionMetadata(
            num_reqs=r + 1, num_tokens=t, block_size=block_size, max_query_len=t, max_seq_len=max_seq_len,
            query_start_loc=self.query_start_loc[:r + 2], query_lens=self.query_lens[:r + 1],
            seq_lens=self.seq_lens[:r + 1], slot_mapping=self.slot_mapping[:t], block_tables=self.block_tables[:r + 1],
            query_lens_cpu=np.zeros(r + 1, np.int32), seq_lens_cpu=np.zeros(r + 1, np.int32))

    def segments(self, shape: GraphShape) -> LoraSegments:
        n = self.lora_segs.shape[1]
        return LoraSegments(self.lora_tokens[:shape.key.tokens], self.lora_segs[0], self.lora_segs[1],
                            self.lora_segs[2], shape.key.tokens, shape.key.tokens, ((0, 0, 0),) * n)

    def fill(self, shape: GraphShape, input_ids: torch.Tensor, positions: torch.Tensor,
             common: CommonAttentionMetadata, tile_req: torch.Tensor, tile_qstart: torch.Tensor,
             logits_indices: torch.Tensor, lora: LoraSegments | None) -> None:
        """Copy one step into the leading rows and pad the rest (device-side copies and fills only)."""
        t, r, nt = shape.key.tokens, shape.max_reqs, shape.max_tiles
        n_tok, n_req, n_tiles, n_log = common.num_tokens, common.num_reqs, tile_req.shape[0], logits_indices.shape[0]
        self.input_ids[:n_tok].copy_(input_ids, non_blocking=True)
        self.positions[:n_tok].copy_(positions, non_blocking=True)
        self.slot_mapping[:n_tok].copy_(common.slot_mapping, non_blocking=True)
        self.slot_mapping[n_tok:t].fill_(-1)
        self.query_start_loc[:n_req + 1].copy_(common.query_start_loc, non_blocking=True)
        self.query_start_loc[n_req + 1:r + 2].fill_(n_tok)
        self.seq_lens[:n_req].copy_(common.seq_lens, non_blocking=True)
        self.seq_lens[n_req:r + 1].fill_(0)
        self.block_tables[:n_req, :common.block_tables.shape[1]].copy_(common.block_tables, non_blocking=True)
        self.tile_req[:n_tiles].copy_(tile_req, non_blocking=True)
        self.tile_req[n_tiles:nt].fill_(r)                     # the spare request: no query, no key
        self.tile_qstart[:n_tiles].copy_(tile_qstart, non_blocking=True)
        self.tile_qstart[n_tiles:nt].fill_(0)
        self.logits_indices[:n_log].copy_(logits_indices, non_blocking=True)
        self.logits_indices[n_log:t].fill_(0)
        if lora is not None:
            pad_segments(lora, self.lora_tokens[:t], self.lora_segs)


class StepGraphRunner:
    """capture=True (CUDA): one graph per GraphKey of the plan, replayed. capture=False: the same padding and static
    metadata, run eagerly (CPU tests; no speed-up)."""

    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, max_model_len: int,
                 plan: CapturePlan, lora=None, capture: bool = True):
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.max_model_len, self.plan, self.capture, self.lora = max_model_len, plan, capture, lora
        self.device = kv_caches[0].device
        max_loras = lora.store.scale.shape[0] if lora is not None else 1
        self.buffers = StaticBuffers.allocate(list(plan.shapes.values()), -(-max_model_len // block_size),
                                              max_loras, self.device)
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._metadata = {key: self._build_metadata(shape) for key, shape in plan.shapes.items()}
        self.replays: dict[GraphKey, int] = {}                 # key -> steps it served (tests, logs)

    def capture_all(self) -> None:
        """Warm up (compiles every kernel variant) and capture, largest first so smaller graphs reuse its pool."""
        pool = torch.cuda.graph_pool_handle()
        for key in self.plan.capture_order():
            shape = self.plan.shapes[key]
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(shape)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(shape)
            self.graphs[key] = (graph, out)
        torch.cuda.synchronize(self.device)
        log.info("captured %d CUDA graphs: %s", len(self.graphs), ", ".join(
            f"{k.kind}{'+lora' if k.lora else ''} x{k.tokens}" for k in self.plan.capture_order()))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, common: CommonAttentionMetadata,
            attn_plan: AttentionPlan, logits_indices: torch.Tensor, with_lora: bool = False,
            prompt_logprobs: bool = False) -> torch.Tensor | None:
        """hidden [S, hidden] at logits_indices, or None when this step runs eagerly (capture_plan.Choice)."""
        choice = self.plan.choose(common.query_lens_cpu, logits_indices.shape[0], with_lora, prompt_logprobs,
                                  needs_split=attn_plan.num_splits > 1 and common.max_query_len > 1)
        shape = choice.shape
        if shape is None or common.block_tables.shape[1] > self.buffers.block_tables.shape[1]:
            return None
        lora_seg = self.lora.layers.segments if with_lora else None
        self.buffers.fill(shape, input_ids, positions, common, attn_plan.tile_req, attn_plan.tile_qstart,
                          logits_indices, lora_seg)
        self.replays[shape.key] = self.replays.get(shape.key, 0) + 1
        if self.capture:
            graph, out = self.graphs[shape.key]
            graph.replay()
        else:
            out = self._forward(shape)
        return out[:logits_indices.shape[0]]

    def _build_metadata(self, shape: GraphShape):
        """The attention metadata over the static buffers: the tiles' views and a fixed split count."""
        from steploop.gpu_worker.attention.triton_backend import TritonAttentionMetadata
        from steploop.gpu_worker.kernels.paged_attention import AttentionPlan, choose_num_splits, num_sms

        backend = self.model.backend
        b, common = self.buffers, self.buffers.common(shape, self.block_size, self.max_model_len)
        splits = 1
        if shape.key.kind == "decode":       # planned for the longest context the model allows
            splits = backend.num_splits or choose_num_splits(shape.max_tiles * backend.num_kv_heads,
                                                             self.max_model_len, 1, num_sms(self.device))
        cls = shape_class(1 if shape.key.kind == "decode" else 2, splits)
        plan = AttentionPlan(common.query_start_loc, common.seq_lens, common.block_tables,
                             b.tile_req[:shape.max_tiles], b.tile_qstart[:shape.max_tiles], shape.key.tokens,
                             shape.block_q, splits, backend.launch.get(cls, DEFAULT_LAUNCH))
        return TritonAttentionMetadata(common, common.slot_mapping, plan)

    def _forward(self, shape: GraphShape) -> torch.Tensor:
        b, t = self.buffers, shape.key.tokens
        if shape.key.lora and self.capture:
            self.lora.layers.begin_all(b.segments(shape))
        try:
            return self.model(b.input_ids[:t], b.positions[:t], self.kv_caches, self._metadata[shape.key],
                              b.logits_indices[:t])
        finally:
            if shape.key.lora and self.capture:
                self.lora.layers.end()
