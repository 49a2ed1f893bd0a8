"""RMSNorm (+ residual), neox rotary and SiLU-and-mul kernels against their references."""

from __future__ import annotations

import pytest
import torch

from steploop.gpu_worker.kernels.fused import rms_norm, rotary_neox, silu_and_mul
from steploop.gpu_worker.kernels.reference import (
    fused_add_rms_norm_ref,
    rms_norm_ref,
    rotary_neox_ref,
    silu_and_mul_ref,
)
from steploop.gpu_worker.model.rotary import RotaryEmbedding
from tests.kernels.conftest import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rand(*shape, dtype, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [576, 100])
def test_rms_norm(dtype, hidden, device):
    x, w = rand(5, hidden, dtype=dtype), rand(hidden, dtype=dtype, seed=1)
    assert_close(rms_norm(x.to(device), w.to(device), 1e-5), rms_norm_ref(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm_in_place(dtype, device):
    x, r, w = rand(7, 576, dtype=dtype), rand(7, 576, dtype=dtype, seed=2), rand(576, dtype=dtype, seed=3)
    want_y, want_r = fused_add_rms_norm_ref(x, r, w, 1e-6)
    xd, rd = x.to(device), r.to(device)
    y, res = rms_norm(xd, w.to(device), 1e-6, rd)
    assert y.data_ptr() == xd.data_ptr() and res.data_ptr() == rd.data_ptr()
    assert_close(res, want_r, dtype)
    assert_close(y, want_y, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((4, 2), 128)])
def test_rotary_in_place_on_views(dtype, heads, head_dim, device):
    """q and k are strided views of one qkv row, as in the model; llama3 scaling tables as Llama 3 uses."""
    h, hk = heads
    rope = RotaryEmbedding(head_dim, 64, 500000.0, {"rope_type": "llama3", "factor": 8.0,
                                                    "original_max_position_embeddings": 16})
    rope.build_cache(torch.device("cpu"), dtype)
    t = 6
    qkv = rand(t, (h + 2 * hk) * head_dim, dtype=dtype)
    positions = torch.tensor([0, 1, 17, 5, 63, 40])
    want_q, want_k = rotary_neox_ref(positions, qkv[:, :h * head_dim].view(t, h, head_dim),
                                     qkv[:, h * head_dim:(h + hk) * head_dim].view(t, hk, head_dim),
                                     rope.cos, rope.sin)
    qkv = qkv.to(device)
    q, k = qkv[:, :h * head_dim].view(t, h, head_dim), qkv[:, h * head_dim:(h + hk) * head_dim].view(t, hk, head_dim)
    rotary_neox(positions.to(device), q, k, rope.cos.to(device), rope.sin.to(device))
    assert_close(q, want_q, dtype)
    assert_close(k, want_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [1536, 37])
def test_silu_and_mul(dtype, inter, device):
    x = rand(3, 2 * inter, dtype=dtype)
    assert_close(silu_and_mul(x.to(device)), silu_and_mul_ref(x), dtype)
