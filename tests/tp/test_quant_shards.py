"""Quantized weights cut for one tensor-parallel rank at their stored width (gguf/block_shards.py,
model/quant/shards.py): each rank's share holds half the bytes of the whole and dequantizes to exactly the whole
layer's rows / columns, and a cut off a block or group boundary is refused at start naming the layer and sizes
(distributed/stored_split.py). The served models are in test_quant_tp.py."""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from steploop.gpu_worker.distributed.shapes import TensorParallelShapeError, rank_share
from steploop.gpu_worker.distributed.sharding import CheckpointSharder
from steploop.gpu_worker.distributed.stored_split import check_stored_split, group_misfits
from steploop.gpu_worker.gguf import blocks
from steploop.gpu_worker.gguf.block_shards import shard_raw
from steploop.gpu_worker.model.quant.config import QuantScheme
from steploop.gpu_worker.model.quant.formats import Fp8Weight, IntWeight, dequantize
from steploop.gpu_worker.model.quant.linear import QuantLinear
from steploop.gpu_worker.model.quant.shards import shard_weight
from tests.tp.test_shapes import SMOLLM
from tests.worker.gguf_files import quantize

# 4 heads of 64 (o_proj K = 256), 2 KV heads, MLP 512 (down_proj K = 512)
LLAMA = dataclasses.replace(SMOLLM, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
O_PROJ, DOWN, Q_PROJ = ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight",
                        "model.layers.0.self_attn.q_proj.weight")


def _sharders(cfg=LLAMA, n: int = 2) -> list[CheckpointSharder]:
    return [CheckpointSharder(cfg, rank_share(cfg, r, n)) for r in range(n)]


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1])
@pytest.mark.parametrize("name", [Q_PROJ, DOWN])
def test_gguf_blocks_cut_per_rank_hold_half_and_dequantize_to_the_whole(qtype, name):
    n, k = (256, 256) if name == Q_PROJ else (256, 512)
    raw = quantize(np.random.default_rng(1).standard_normal((n, k)).astype(np.float32) * 0.1, qtype)
    whole = torch.from_numpy(np.array(gguf_quants.dequantize(raw, qtype), dtype=np.float32).reshape(n, k))
    for sharder in _sharders():
        part, local_k = shard_raw(sharder, name, raw, qtype, k)
        assert part.nbytes * 2 == raw.nbytes               # at width: half the file's bytes on each rank
        got = blocks.dequantize(blocks.decode(part, qtype, local_k))
        assert torch.equal(torch.from_numpy(got), sharder.shard(name, whole))


def test_gguf_vocabulary_rows_pad_with_zero_blocks():
    cfg = dataclasses.replace(LLAMA, vocab_size=1001)        # 501 rows per rank, the last one padding
    raw = quantize(np.random.default_rng(2).standard_normal((1001, 256)).astype(np.float32), T.Q8_0)
    rows = [shard_raw(s, "lm_head.weight", raw, T.Q8_0, 256)[0] for s in _sharders(cfg)]
    assert [r.shape[0] for r in rows] == [501, 501]
    last = blocks.dequantize(blocks.decode(rows[1], T.Q8_0, 256))
    assert not last[-1].any() and last[-2].any()


def test_gguf_cut_off_a_super_block_is_a_bug_here():
    raw = quantize(np.zeros((256, 256), np.float32), T.Q4_K)     # o_proj K 256: 128 per rank, half a super-block
    with pytest.raises(ValueError, match="not whole Q4_K blocks of 256.*read it as fp32"):
        shard_raw(_sharders()[0], O_PROJ, raw, T.Q4_K, 256)


def _int_weight(n: int, k: int, gs: int, g_idx: torch.Tensor | None = None, bits: int = 4) -> IntWeight:
    gen = torch.Generator().manual_seed(3)
    groups = k // gs
    return IntWeight(torch.randint(0, 2 ** bits, (n, k), generator=gen, dtype=torch.uint8),
                     torch.rand(n, groups, generator=gen) + 0.1, torch.randint(0, 2 ** bits, (n, groups),
                                                                               generator=gen).float(), g_idx, gs, bits)


@pytest.mark.parametrize("gs", [32, 64, 256])       # 256: per channel on o_proj (K 256)
def test_int_weights_cut_rows_and_group_columns_exactly(gs):
    o_proj, q_proj = _int_weight(256, 256, gs), _int_weight(256, 256, gs)
    for sharder in _sharders():
        for name, w in ((O_PROJ, o_proj), (Q_PROJ, q_proj)):
            part = shard_weight(w, sharder.split(name), name)
            assert part.q.numel() * 2 == w.q.numel()
            assert torch.equal(dequantize(part), sharder.shard(name, dequantize(w)))


def test_int_weight_cut_inside_a_group_is_refused():
    with pytest.raises(ValueError, match="not whole groups of 64"):
        shard_weight(_int_weight(256, 256, 64), (1, 32, 96), O_PROJ)
    assert shard_weight(_int_weight(256, 256, 256), (1, 96, 64), O_PROJ).scale.shape == (256, 1)  # per channel


def test_fp8_row_parallel_ranks_quantize_activations_with_the_whole_rows_scale():
    """Each rank's e4m3 activations use the whole row's amax (the all-reduce max), so the ranks' partial sums add
    up to the one-rank layer's output (fp32 reordering only)."""
    gen = torch.Generator().manual_seed(8)
    w = Fp8Weight((torch.randn(64, 256, generator=gen) * 10).to(torch.float8_e4m3fn), torch.rand(64, 1) / 100)
    x = torch.randn(5, 256, generator=gen)
    x[:, 200] = 40.0                                # the largest value sits in rank 1's half
    whole = QuantLinear(256, 64, False, ["o"])
    whole.loaded["o"] = w
    whole.finish(torch.device("cpu"), use_c=True)
    amax = x.abs().amax(-1, keepdim=True)
    total = torch.zeros(5, 64)
    for rank, sharder in enumerate(_sharders()):
        layer = QuantLinear(128, 64, False, ["o"])
        layer.loaded["o"] = shard_weight(w, sharder.split(O_PROJ), O_PROJ)
        layer.finish(torch.device("cpu"), use_c=True)
        layer.split_input(lambda local: torch.maximum(local, amax))      # the group's max over both halves
        total += layer(x[:, rank * 128:(rank + 1) * 128])
    torch.testing.assert_close(total, whole(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("even", [True, False])
def test_act_order_columns_keep_their_groups(even):
    k, gs = 256, 64
    if even:     # each rank's half holds 32 columns of every group: packs as group 32
        g_idx = torch.arange(k) % (k // gs)
    else:
        g_idx = torch.randperm(k, generator=torch.Generator().manual_seed(5)) // gs
    w = _int_weight(256, k, gs, g_idx.long())
    for sharder in _sharders():
        part = shard_weight(w, sharder.split(O_PROJ), O_PROJ)
        assert torch.equal(dequantize(part), sharder.shard(O_PROJ, dequantize(w)))
        assert part.group_size == (32 if even else 0)
        layer = QuantLinear(128, 256, False, ["o"])
        layer.loaded["o"] = part
        layer.finish(torch.device("cpu"), use_c=True)
        x = torch.randn(3, 128, generator=torch.Generator().manual_seed(6))
        torch.testing.assert_close(layer(x), x @ dequantize(part).T, rtol=1e-5, atol=1e-5)
        kinds = layer.extra_repr()
        assert ("torch" in kinds) == (not even), kinds


def test_fp8_cuts_rows_with_their_scales_and_columns_under_one_scale():
    gen = torch.Generator().manual_seed(7)
    weight = (torch.randn(256, 256, generator=gen) * 10).to(torch.float8_e4m3fn)
    for scale in (torch.rand(256, 1, generator=gen), torch.rand(1, 1, generator=gen)):
        w = Fp8Weight(weight, scale)
        for sharder in _sharders():
            for name in (Q_PROJ, O_PROJ):
                part = shard_weight(w, sharder.split(name), name)
                assert part.weight.dtype == torch.float8_e4m3fn and part.weight.numel() * 2 == weight.numel()
                assert torch.equal(dequantize(part), sharder.shard(name, dequantize(w)))


def test_group_misfits_name_the_layer_and_sizes():
    qwen2 = dataclasses.replace(LLAMA, hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                                intermediate_size=256)               # head_dim 64: o_proj K 128, 64 per rank
    cfg = dataclasses.replace(qwen2, quant=QuantScheme("gptq", "int", 4, 128, True))
    sharder = _sharders(cfg)[0]
    assert group_misfits(cfg, sharder) == ["o_proj (gptq int4 group 128 sym): 128 input columns, 64 per rank"]
    assert group_misfits(dataclasses.replace(cfg, quant=QuantScheme("awq", "int", 4, 64, False)), sharder) == []
    assert group_misfits(dataclasses.replace(cfg, quant=QuantScheme("gptq", "int", 4, 128, True, True)),
                         sharder) == []                       # act-order: cut by column (shards.py)
    with pytest.raises(TensorParallelShapeError, match=r"^-tp 2: .* o_proj \(gptq int4 group 128 sym\): 128 input"):
        check_stored_split(pathlib.Path("/nonexistent"), cfg, sharder.share)    # no GGUF: the group rule refuses


def test_gguf_k_quant_o_proj_cut_off_its_super_block_is_widened_and_named(tmp_path, model_dir, monkeypatch, caplog):
    """A cut inside a k-quant super-block (Qwen2.5-0.5B's FFN at -tp 2 is one) is not refused: the start-up check
    names the tensor, its type and the sizes, and the loader reads that layer as fp32 (exactness: test_quant_tp)."""
    from steploop.gpu_worker.gguf.block_shards import cut_inside_blocks
    from steploop.gpu_worker.gguf_convert import convert_gguf
    from steploop.gpu_worker.model.model_config import LlamaModelConfig
    from tests.worker.gguf_files import random_model, write_gguf
    monkeypatch.setenv("STEPLOOP_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(random_model("LlamaConfig", tie_word_embeddings=False), tmp_path / "llama.gguf", model_dir,
                      qtype_of=lambda name, w: T.Q4_K if "attn_output" in name else T.Q8_0)
    folder = convert_gguf(path)
    cfg = LlamaModelConfig.from_dir(folder)
    share = rank_share(cfg, 0, 2)
    with caplog.at_level("WARNING"):
        check_stored_split(folder, cfg, share)
    assert "blk.0.attn_output.weight (Q4_K, blocks of 256): 256 input columns, 128 per rank" in caplog.text
    assert "as fp32" in caplog.text
    sharder = CheckpointSharder(cfg, share)
    assert cut_inside_blocks(sharder, O_PROJ, T.Q4_K) and not cut_inside_blocks(sharder, O_PROJ, T.Q8_0)
