"""The GGUF GEMM (kernels/gguf_gemm.py) on each block type's held form (gguf/triton_linear.py): the form's values
equal gguf-py's dequantize bit for bit, and x @ W^T matches the fp32 reference on those values, for decode- and
prompt-sized batches, fp32 and bf16 activations, a linear of two runs of different types (Q4_K_M's q/k and v)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from steploop.gpu_worker.gguf import blocks
from steploop.gpu_worker.gguf.triton_linear import GgufBlocks, GgufLinear
from tests.kernels.conftest import assert_close
from tests.worker.gguf_files import quantize

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]


def held(qtype: T, n: int, k: int, device, seed: int = 0) -> tuple[GgufBlocks, torch.Tensor]:
    """(the form on the device, gguf-py's fp32 dequantization [n, k]) of a random weight."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = quantize(w, qtype, seed=seed)
    want = torch.from_numpy(gguf_quants.dequantize(raw, qtype).reshape(n, k).astype(np.float32))
    half = n // 2                                   # two chunks of rows, as the loader decodes them
    pieces = [blocks.decode(raw[:half], qtype, k), blocks.decode(raw[half:], qtype, k)]
    return GgufBlocks.from_decoded(pieces, device), want


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_form_holds_gguf_py_values(qtype, device):
    form, want = held(qtype, 40, 512, device)
    assert torch.equal(form.dequantized().cpu(), want)
    bits = form.nbytes * 8 / want.numel()
    assert bits <= (6 if qtype in (T.Q4_0, T.Q4_1, T.Q4_K) else 10)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [3, 37])
def test_gemm_matches_reference(qtype, rows, device):
    form, w = held(qtype, 72, 256, device, seed=rows)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1))
    got = form(x.to(device)).cpu()
    assert_close(got, x @ w.T, torch.float32)


def test_bf16_activations_and_two_runs(device):
    q4k, w1 = held(T.Q4_K, 64, 256, device, seed=3)
    q6k, w2 = held(T.Q6_K, 32, 256, device, seed=4)
    bias = torch.nn.Parameter(torch.randn(96, generator=torch.Generator().manual_seed(5)).to(device))
    layer = GgufLinear([q4k, q6k], bias)
    assert (layer.in_features, layer.out_features, layer.weight) == (256, 96, None)
    x = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(2))
    want = x @ torch.cat([w1, w2]).T + bias.detach().cpu()
    assert_close(layer(x.to(device)).cpu().detach(), want, torch.float32)
    got = layer(x.to(device, torch.bfloat16)).cpu().float().detach()      # bf16 in, products summed in fp32
    x16 = x.bfloat16().float()
    assert_close(got, x16 @ torch.cat([w1, w2]).T + bias.detach().cpu(), torch.bfloat16)
