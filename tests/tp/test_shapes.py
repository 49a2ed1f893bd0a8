"""Which -tp sizes a model's shapes allow, the refusal's message, and each rank's checkpoint slices."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from steploop.gpu_worker.distributed.shapes import (
    TensorParallelShapeError,
    check_splittable,
    local_config,
    rank_share,
    sizes_that_work,
)
from steploop.gpu_worker.distributed.sharding import CheckpointSharder
from steploop.gpu_worker.model.model_config import ModelConfig

SMOLLM = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
                     max_position_embeddings=8192, tie_word_embeddings=True)


def test_default_model_refuses_tp2_naming_the_numbers():
    with pytest.raises(TensorParallelShapeError) as err:
        check_splittable(SMOLLM, 2)
    message = str(err.value)
    assert "-tp 2" in message and "9 attention heads" in message and "3 KV heads" in message
    assert message.endswith("sizes that divide: 1, 3")


def test_sizes_that_work():
    assert sizes_that_work(SMOLLM) == [1, 3]
    four = dataclasses.replace(SMOLLM, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1024)
    assert sizes_that_work(four) == [1, 2, 4, 8]        # 4 and 8 replicate the 2 KV heads


def test_replicated_kv_heads():
    cfg = dataclasses.replace(SMOLLM, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1024)
    shares = [rank_share(cfg, r, 4) for r in range(4)]
    assert [s.first_kv_head for s in shares] == [0, 0, 1, 1]
    assert all(s.num_kv_heads == 1 and s.num_heads == 2 for s in shares)
    # rank r's q heads 2r, 2r+1 belong to KV head (2r) // 4 (4 q heads per KV head)
    assert all(s.first_kv_head == s.first_head // 4 for s in shares)


def test_sharder_slices_rows_columns_and_pads_the_vocab():
    cfg = dataclasses.replace(SMOLLM, vocab_size=10, hidden_size=4, num_attention_heads=3, num_key_value_heads=3,
                              head_dim=2, intermediate_size=6)
    share = rank_share(cfg, 2, 3)
    sharder = CheckpointSharder(cfg, share)
    q = torch.arange(6 * 4).reshape(6, 4)
    assert torch.equal(sharder.shard("model.layers.0.self_attn.q_proj.weight", q), q[4:6])
    o = torch.arange(4 * 6).reshape(4, 6)
    assert torch.equal(sharder.shard("model.layers.0.self_attn.o_proj.weight", o), o[:, 4:6])
    assert torch.equal(sharder.shard("model.layers.0.mlp.down_proj.bias", torch.ones(4)), torch.zeros(4))
    emb = torch.arange(10 * 4).reshape(10, 4).float()
    part = sharder.shard("model.embed_tokens.weight", emb)     # rows 8..11 of the padded 12: 8, 9, then zeros
    assert part.shape == (4, 4) and torch.equal(part[:2], emb[8:]) and not part[2:].any()
    assert local_config(cfg, share).vocab_size == 4
