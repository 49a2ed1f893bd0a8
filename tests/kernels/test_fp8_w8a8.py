"""The FP8 W8A8 Triton kernel under the interpreter (exact e4m3 decode, fp32 IEEE products) against its torch
reference, per-tensor and per-channel weight scales; every e4m3 byte decodes to torch's own value."""

from __future__ import annotations

import pytest
import torch

from steploop.gpu_worker.kernels.fp8_w8a8 import fp8_w8a8_linear, fp8_w8a8_reference
from steploop.gpu_worker.model.quant.linear import quantize_fp8_per_token


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("m", [1, 5, 70])
def test_fp8_w8a8_matches_reference(m, per_channel):
    n, k = 80, 192
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(n, k, generator=gen) * 0.05
    w_scale = (w.abs().amax(-1, keepdim=True) if per_channel else w.abs().amax().reshape(1, 1)) / 448
    wq = (w / w_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    xq, x_scale = quantize_fp8_per_token(torch.randn(m, k, generator=gen))
    got = fp8_w8a8_linear(xq, x_scale, wq, w_scale, torch.float32, interpret=True)
    torch.testing.assert_close(got, fp8_w8a8_reference(xq, x_scale, wq, w_scale, torch.float32), rtol=1e-6,
                               atol=1e-6)


def test_every_e4m3_byte_decodes_exactly():
    """Row 0 of x holds all 254 finite e4m3 values (NaNs 0x7f / 0xff left out); w is the identity."""
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    xq = codes.view(torch.float8_e4m3fn)[None, :]
    eye = torch.eye(codes.numel()).to(torch.float8_e4m3fn)
    ones = torch.ones(1, 1)
    got = fp8_w8a8_linear(xq, ones, eye, ones, torch.float32, interpret=True)
    assert torch.equal(got[0], xq[0].float())
