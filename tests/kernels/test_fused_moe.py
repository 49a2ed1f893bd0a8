"""The fused-MoE kernel: the expert alignment, the two grouped GEMMs against the slow reference, and model/moe.py's
dispatch to it against its own torch loop."""

from __future__ import annotations

import pytest
import torch

from steploop.gpu_worker.kernels.fused_moe import choose_block_m, fused_experts, moe_align_block_size
from steploop.gpu_worker.kernels.reference import fused_moe_ref
from steploop.gpu_worker.model import moe
from tests.kernels.conftest import assert_close


def routed(t: int, hidden: int, inter: int, experts: int, top_k: int, dtype=torch.float32, device=None, seed=0,
           ids: torch.Tensor | None = None):
    """x, w13, w2 and a softmax top-k routing (renormalised) of t tokens."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((t, hidden), generator=gen)
    w13 = torch.randn((experts, 2 * inter, hidden), generator=gen) * hidden ** -0.5
    w2 = torch.randn((experts, hidden, inter), generator=gen) * inter ** -0.5
    weights, topk_ids = torch.randn((t, experts), generator=gen).softmax(-1).topk(top_k, dim=-1)
    if ids is not None:
        topk_ids = ids
    weights = weights / weights.sum(-1, keepdim=True)
    return [a.to(device) for a in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, topk_ids)]


@pytest.mark.parametrize("block_m", [16, 64])
def test_align_groups_pairs_by_expert(block_m):
    topk_ids = torch.tensor([[2, 0], [2, 3], [0, 2], [2, 1], [3, 2]])        # expert 2: 5 pairs, 1: 1, 0: 2, 3: 2
    sorted_ids, block_expert, num_padded = moe_align_block_size(topk_ids, block_m, 5)      # expert 4: none
    num_pairs = topk_ids.numel()
    assert num_padded.item() == 4 * block_m and sorted_ids.numel() % block_m == 0
    assert sorted_ids.numel() >= num_padded.item()
    runs = sorted_ids[:num_padded.item()].view(-1, block_m)
    flat = topk_ids.reshape(-1)
    for block, expert in zip(runs, block_expert.tolist()):
        real = block[block < num_pairs]
        assert (flat[real.long()] == expert).all()
        assert real.tolist() == sorted(real.tolist())                          # token order inside an expert
    assert block_expert[:4].tolist() == [0, 1, 2, 3]
    assert sorted(sorted_ids[sorted_ids < num_pairs].tolist()) == list(range(num_pairs))   # each pair once


def test_block_rows_choice():
    assert choose_block_m(num_pairs=2, num_experts=8) == 16          # a decode
    assert choose_block_m(num_pairs=4096, num_experts=8) == 64       # a prompt


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("shape", [(5, 64, 32, 4, 2), (37, 128, 96, 8, 2), (40, 72, 48, 4, 2)],
                         ids=["decode-like", "uneven-dims", "block64"])
def test_fused_experts_fp32(activation, shape, device):
    """(tokens, hidden, intermediate, experts, top_k); 72 and 96 are not multiples of the K / N blocks; 80 pairs
    over 4 experts take the 64-row blocks."""
    x, w13, w2, weights, ids = routed(*shape, device=device, seed=shape[0])
    assert_close(fused_experts(x, w13, w2, weights, ids, activation), fused_moe_ref(x, w13, w2, weights, ids,
                                                                                    activation), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fused_experts_16bit(dtype, device):
    """bf16 under the interpreter runs the fp32-upcast dot path (the interpreter's bf16 tl.dot is wrong); the native
    bf16 dot is covered when this runs compiled on a GPU."""
    x, w13, w2, weights, ids = routed(19, 128, 64, 8, 2, dtype=dtype, device=device)
    got = fused_experts(x, w13, w2, weights.to(dtype), ids, "silu")
    assert_close(got, fused_moe_ref(x, w13, w2, weights, ids, "silu"), dtype, scale=2)


def test_one_expert_takes_every_token_and_others_none(device):
    """All 70 tokens on expert 1 (several row blocks of one expert), experts 0, 2, 3 idle."""
    x, w13, w2, weights, ids = routed(70, 64, 32, 4, 1, device=device, ids=torch.ones((70, 1), dtype=torch.int64))
    weights = torch.ones_like(weights)
    assert_close(fused_experts(x, w13, w2, weights, ids, "silu"), fused_moe_ref(x, w13, w2, weights, ids, "silu"),
                 torch.float32)


def random_sparse_moe(spec: moe.MoESpec, act: str, seed: int, device) -> moe.SparseMoE:
    """A SparseMoE of hidden 64 with every parameter drawn at scale 0.2 (seeded: the caller's inputs follow)."""
    layer = moe.SparseMoE(64, spec, act).to(device)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
    return layer


def test_sparse_moe_dispatches_to_the_kernel(monkeypatch, device):
    """model/moe.py's SparseMoE with the dispatch on (it is on for CUDA tensors) against its own torch loop."""
    spec = moe.MoESpec(num_experts=4, top_k=2, intermediate_size=48, renormalize=False, module="mlp",
                       sparse_layers=(0,))
    layer = random_sparse_moe(spec, "gelu_tanh", 3, device)
    x = torch.randn((11, 64)).to(device)
    with torch.no_grad():
        want = layer(x)
        monkeypatch.setattr(moe, "fused_kernel_serves", lambda _x: True)
        got = layer(x)
    assert_close(got, want, torch.float32)


def test_launcher_rejects_bad_inputs(device):
    x, w13, w2, weights, ids = routed(3, 64, 32, 4, 2, device=device)
    with pytest.raises(ValueError, match="activation"):
        fused_experts(x, w13, w2, weights, ids, "relu")
    with pytest.raises(ValueError, match="shapes"):
        fused_experts(x, w13, w2[:, :, :16], weights, ids, "silu")
    with pytest.raises(ValueError, match="dtypes"):
        fused_experts(x, w13.half(), w2, weights, ids, "silu")


def shard_w13(w13: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    """A tensor-parallel rank's w13 as the loader builds it: its gate rows, then its up rows."""
    inter = w13.shape[1] // 2
    size = inter // ranks
    gate, up = w13[:, rank * size:(rank + 1) * size], w13[:, inter + rank * size:inter + (rank + 1) * size]
    return torch.cat([gate, up], dim=1).contiguous()


@pytest.mark.parametrize("ranks", [2, 4])
def test_sharded_experts_sum_to_the_whole(ranks, device):
    """-tp N: each rank's launch over its I / N rows of w13 and columns of w2 is a partial sum; the all-reduce's
    sum of them is the whole layer."""
    x, w13, w2, weights, ids = routed(23, 64, 64, 4, 2, device=device, seed=5)
    size = 64 // ranks
    parts = [fused_experts(x, shard_w13(w13, r, ranks), w2[:, :, r * size:(r + 1) * size].contiguous(), weights,
                           ids, "silu") for r in range(ranks)]
    assert_close(sum(parts), fused_moe_ref(x, w13, w2, weights, ids, "silu"), torch.float32)


def test_align_skips_pairs_of_other_ranks():
    """Id num_experts marks a pair another rank's expert takes: it is in no run."""
    topk_ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    sorted_ids, block_expert, num_padded = moe_align_block_size(topk_ids, 16, 2)   # expert "2": elsewhere
    used = sorted_ids[:num_padded.item()]
    assert num_padded.item() == 32 and block_expert[:2].tolist() == [0, 1]
    assert sorted(used[used < 6].tolist()) == [1, 3, 4]          # the pairs of experts 0 and 1, once each


@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_parallel_ranks_sum_to_the_whole(ranks, device):
    """--enable-expert-parallel: rank r holds experts [r E/N, (r+1) E/N) whole; pairs routed elsewhere add nothing
    there, so the ranks' outputs sum to the whole layer."""
    x, w13, w2, weights, ids = routed(29, 64, 32, 8, 3, device=device, seed=9)
    held = 8 // ranks
    parts = [fused_experts(x, w13[r * held:(r + 1) * held], w2[r * held:(r + 1) * held], weights, ids, "gelu",
                           first_expert=r * held) for r in range(ranks)]
    assert_close(sum(parts), fused_moe_ref(x, w13, w2, weights, ids, "gelu"), torch.float32)
    none_here = fused_experts(x, w13[:held], w2[:held], weights, torch.full_like(ids, 7), "gelu", first_expert=0)
    assert not none_here.any()


def test_expert_parallel_sparse_moe_kernel_equals_torch_loop(monkeypatch, device):
    """model/moe.py's SparseMoE holding experts 2-3 of 4 (a rank's local spec): the kernel path equals its loop."""
    spec = moe.MoESpec(num_experts=4, top_k=2, intermediate_size=32, renormalize=True, module="mlp",
                       sparse_layers=(0,), first_expert=2, local_experts=2)
    layer = random_sparse_moe(spec, "silu", 4, device)
    assert layer.w13.shape[0] == 2
    x = torch.randn((13, 64)).to(device)
    with torch.no_grad():
        want = layer(x)
        monkeypatch.setattr(moe, "fused_kernel_serves", lambda _x: True)
        got = layer(x)
    assert want.abs().sum() > 0
    assert_close(got, want, torch.float32)


def test_sparse_moe_with_experts_held_per_expert_runs_its_loop(monkeypatch, device):
    """Experts whose down projections alone are held per expert (as a checkpoint quantizing only them loads) run the
    expert loop with the dispatch on: the fused kernel reads both stacks, and w2's is gone."""
    spec = moe.MoESpec(num_experts=4, top_k=2, intermediate_size=32, renormalize=True, module="mlp",
                       sparse_layers=(0,))
    layer = random_sparse_moe(spec, "silu", 5, device)
    x = torch.randn((9, 64)).to(device)
    with torch.no_grad():
        want = layer(x)
        downs = []
        for e in range(4):
            down = torch.nn.Linear(32, 64, bias=False).to(device)
            down.weight.copy_(layer.w2[e])
            downs.append(down)
        layer.use_quantized("w2", downs)
        monkeypatch.setattr(moe, "fused_kernel_serves", lambda _x: True)
        got = layer(x)
    assert layer.w2 is None
    assert_close(got, want, torch.float32)
