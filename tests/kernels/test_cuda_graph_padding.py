"""The CPU-testable half of the CUDA-graph path: the capture plan (which shapes are captured, which graph each step
replays, why a step runs eagerly), padding into static buffers, backend choice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from steploop.gpu_worker.attention.metadata import build_common_metadata
from steploop.gpu_worker.capture_plan import CapturePlan, GraphKey, graph_plan
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.cuda_graphs import StaticBuffers
from steploop.gpu_worker.lora.segments import build_lora_segments

# Llama-3-8B's GQA (32 / 8 heads: 4 query heads per KV head), the scheduler's defaults, LoRA on
PLAN = CapturePlan(qpk_p=4, max_reqs=128, max_tokens=2048, lora=True)


def test_the_captured_shapes():
    decode = [k.tokens for k in PLAN.capture_order() if k.kind == "decode" and not k.lora]
    mixed = [k.tokens for k in PLAN.capture_order() if k.kind == "mixed" and not k.lora]
    assert decode == [128, 64, 32, 16, 8, 4, 2, 1]                 # largest first (the pool), <= max_num_seqs
    assert mixed == [2048, 1024, 512, 256, 128, 64, 32, 16]
    assert len(PLAN.capture_order()) == 2 * (8 + 8)                          # and each again with LoRA armed
    big = PLAN.shapes[GraphKey("mixed", 2048, False)]
    assert (big.max_reqs, big.block_q, big.max_tiles) == (128, 16, 2048 // 16 + 128)
    assert PLAN.shapes[GraphKey("decode", 8, True)].block_q == 4    # 16-row tiles of 4 heads: 4 tokens
    assert not any(k.lora for k in CapturePlan(4, 128, 2048, lora=False).capture_order())


@pytest.mark.parametrize("query_lens,logits,lora,want", [
    ([1, 1, 1], 3, False, ("decode", 4, False)),                    # 3 decodes -> the 4 graph
    ([1] * 128, 128, True, ("decode", 128, True)),                  # a LoRA decode batch
    ([1, 1], 4, False, ("mixed", 16, False)),                       # drafts: 4 logits rows for 2 requests
    ([100, 1, 1], 3, False, ("mixed", 128, False)),                 # a prompt chunk among decodes
    ([700, 1, 300], 3, True, ("mixed", 1024, True)),                # a mixed LoRA step
    ([2000] + [1] * 48, 49, False, ("mixed", 2048, False)),
])
def test_which_graph_a_step_replays(query_lens, logits, lora, want):
    choice = PLAN.choose(np.array(query_lens, np.int32), logits, lora)
    assert choice.shape is not None, choice.why_eager
    assert (choice.shape.key.kind, choice.shape.key.tokens, choice.shape.key.lora) == want


def test_tiles_and_requests_bound_the_graph_as_well_as_tokens():
    # 20 requests of 3 tokens: 60 tokens fit the 64 graph, but its 64 request rows do too; tiles: 20 <= 64/16 + 64
    assert PLAN.choose(np.full(20, 3, np.int32), 20).shape.key.tokens == 64
    small = CapturePlan(qpk_p=4, max_reqs=8, max_tokens=2048, lora=False)
    choice = small.choose(np.full(12, 3, np.int32), 12)
    assert choice.shape is None and "requests" in choice.why_eager     # 12 requests > every graph's 8 rows


@pytest.mark.parametrize("query_lens,logits,kwargs,why", [
    ([1, 1], 2, {"prompt_logprobs": True}, "prompt-logprob"),
    ([3000], 1, {}, "exceed"),
    ([1] * 129, 129, {}, "exceed"),                                 # past 128 requests: no graph holds them
    ([5, 1], 2, {"needs_split": True}, "split-KV"),
])
def test_steps_that_run_eagerly_say_why(query_lens, logits, kwargs, why):
    choice = PLAN.choose(np.array(query_lens, np.int32), logits, **kwargs)
    assert choice.shape is None and why in choice.why_eager
    assert "LoRA" in CapturePlan(4, 128, 2048, lora=False).choose(np.ones(2, np.int32), 2, True).why_eager


def test_worker_plan_follows_the_scheduler_flags():
    cfg = type("Cfg", (), {"num_attention_heads": 9, "num_key_value_heads": 3})()
    plan = graph_plan(WorkerConfig(max_num_seqs=32, max_num_batched_tokens=512), cfg, lora=False)
    assert plan.qpk_p == 4 and max(k.tokens for k in plan.capture_order() if k.kind == "decode") == 32
    assert max(k.tokens for k in plan.capture_order() if k.kind == "mixed") == 512
    big = graph_plan(WorkerConfig(max_num_batched_tokens=16384), cfg, lora=True)
    assert max(k.tokens for k in big.capture_order()) == 2048                  # larger steps run eagerly (prefill-bound)


def test_static_buffers_pad_a_mixed_step():
    plan = CapturePlan(qpk_p=2, max_reqs=4, max_tokens=16, lora=True, decode_sizes=(1, 2, 4), mixed_sizes=(16,))
    shape = plan.choose(np.array([5, 1, 3], np.int32), 3, True).shape
    assert shape.key == GraphKey("mixed", 16, True)
    b = StaticBuffers.allocate(list(plan.shapes.values()), max_blocks=4, max_loras=3, device=torch.device("cpu"))
    b.seq_lens.fill_(99)
    tables = np.array([[3, 4], [5, 0], [6, 7]], np.int32)
    common = build_common_metadata(np.array([5, 1, 3], np.int32), np.array([20, 2, 17], np.int32), tables,
                                   np.arange(60, 69, dtype=np.int64), 16, torch.device("cpu"))
    seg = build_lora_segments(torch.tensor([1, 1, 1, 1, 1, -1, 0, 0, 0]))
    b.fill(shape, torch.arange(9), torch.arange(9), common, torch.tensor([0, 1, 2], dtype=torch.int32),
           torch.zeros(3, dtype=torch.int32), torch.tensor([4, 5, 8]), seg)
    assert b.slot_mapping[:16].tolist() == list(range(60, 69)) + [-1] * 7
    assert b.query_start_loc[:6].tolist() == [0, 5, 6, 9, 9, 9]      # request 3 (pad) and 4 (spare): empty
    assert b.seq_lens[:5].tolist() == [20, 2, 17, 0, 0]
    assert b.block_tables[:3, :2].tolist() == tables.tolist()
    assert b.tile_req[:shape.max_tiles].tolist() == [0, 1, 2] + [4] * (shape.max_tiles - 3)   # pads: the spare
    assert b.logits_indices[:16].tolist() == [4, 5, 8] + [0] * 13
    assert b.lora_tokens[:16].tolist() == [6, 7, 8, 0, 1, 2, 3, 4] + [0] * 8
    assert b.lora_segs.tolist() == [[0, 3, 0], [3, 5, 0], [0, 1, 0]]   # (starts, lens, slots); the pad is empty
    static = b.segments(shape)
    assert static.num_tokens == 16 and static.num_segments == 3 and static.max_seg_len == 16


@pytest.mark.parametrize("flag,device,want", [("auto", "cpu", "torch"), ("auto", "cuda", "triton"),
                                              ("torch", "cuda", "torch"), ("triton", "cuda", "triton")])
def test_backend_selection(flag, device, want):
    config = WorkerConfig(attention_backend=flag)
    assert config.resolved_attention_backend(device) == want
    assert config.use_cuda_graphs(device) == (want == "triton" and device == "cuda")
    assert not WorkerConfig(attention_backend=flag, cuda_graphs=False).use_cuda_graphs(device)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        WorkerConfig(attention_backend="triton").resolved_attention_backend("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert WorkerConfig(attention_backend="triton").resolved_attention_backend("cpu") == "triton"
