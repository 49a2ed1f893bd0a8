"""The W4A16 Triton kernel under the interpreter against its torch reference and the formats' reference
dequantization (GPTQ act-order, AWQ, compressed-tensors int4); its sm_80/sm_90 compile is test_quant_compile.py."""

from __future__ import annotations

import pytest
import torch

from steploop.gpu_worker.kernels.w4a16 import Int4Gpu, w4a16_linear, w4a16_reference
from steploop.gpu_worker.model.quant.config import read_quant_config
from steploop.gpu_worker.model.quant.formats import read_linear
from steploop.gpu_worker.model.quant.packing import contiguous_groups
from tests.worker.quant_models import WRITERS, Spec, quantization_config, reference_dequantize


@pytest.mark.parametrize("m", [1, 5, 70])
@pytest.mark.parametrize("spec", [Spec("gptq", 4, 32, False, desc_act=True), Spec("awq", 4, 64, False),
                                  Spec("ct_int", 4, -1, True), Spec("gptq", 4, 128, True)], ids=lambda s: s.id)
def test_w4a16_matches_reference(spec, m):
    n, k = 80, 256          # N off the 64-column tile
    gen = torch.Generator().manual_seed(m)
    stored = WRITERS[spec.method](torch.randn(n, k, generator=gen) * 0.05, spec, gen)
    plain, perm = contiguous_groups(read_linear(read_quant_config(quantization_config(spec)), "l", stored, n, k))
    w = Int4Gpu(plain)
    x = torch.randn(m, k, generator=gen)
    xp = x if perm is None else x.index_select(-1, perm)
    got = w4a16_linear(xp, w, interpret=True)
    torch.testing.assert_close(got, w4a16_reference(xp, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, x @ reference_dequantize(stored, spec, n, k).T, rtol=1e-5, atol=1e-5)


def test_quant_linear_cuda_segment_runs_the_kernel():
    """The segment QuantLinear builds on CUDA (here on CPU tensors under the interpreter): act-order input permuted,
    the W4A16 kernel, the reference result."""
    from steploop.gpu_worker.model.quant.linear import _TritonInt4Segment
    spec = Spec("gptq", 4, 32, False, desc_act=True)
    n, k = 64, 128
    gen = torch.Generator().manual_seed(0)
    stored = WRITERS[spec.method](torch.randn(n, k, generator=gen) * 0.05, spec, gen)
    plain, perm = contiguous_groups(read_linear(read_quant_config(quantization_config(spec)), "l", stored, n, k))
    segment = _TritonInt4Segment(plain, perm, torch.device("cpu"))
    x = torch.randn(2, 3, k, generator=gen)
    torch.testing.assert_close(segment(x), x @ reference_dequantize(stored, spec, n, k).T, rtol=1e-5, atol=1e-5)
