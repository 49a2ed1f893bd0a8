"""Lossless weight packing (cpu_kernels/packed_weights.py) and the packed fp32 matmul (packed_linear.c): the packed
form gives back every weight bit for bit, the kernel matches x @ W.T, a row's result does not depend on its batch,
and the worker packs exactly the packable layers of the real model."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from torch import nn

from steploop.gpu_worker.cpu_kernels import build
from steploop.gpu_worker.cpu_kernels import packed_linear as kernel
from steploop.gpu_worker.cpu_kernels.packed_weights import Q4_1, Q8_0, pack, unpack
from steploop.gpu_worker.model.packed_linear_layer import PackedLinear, pack_linear_weights
from tests.worker.c_kernels import needs_c_kernels

pytestmark = needs_c_kernels(build.runnable_isas())


def gguf_q4_1(n: int, k: int, seed: int) -> torch.Tensor:
    """Random weights through llama.cpp's quantize_row_q4_1_ref and its dequantizer (fp16 d and min, fp32 math)."""
    x = torch.randn(n, k // 32, 32, generator=torch.Generator().manual_seed(seed)) * 0.05
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    q = torch.clamp(((x - lo) / torch.where(d > 0, d, 1.0) + 0.5).floor(), max=15)
    return (d.half().float() * q + lo.half().float()).reshape(n, k)


def gguf_q8_0(n: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, k // 32, 32, generator=torch.Generator().manual_seed(seed))
    d = x.abs().amax(-1, keepdim=True) / 127
    q = torch.round(x / d).to(torch.int8).float()          # stored as int8 by llama.cpp: no -0.0
    return (d.half().float() * q).reshape(n, k)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("make, kind", [(gguf_q4_1, Q4_1), (gguf_q8_0, Q8_0)])
def test_pack_round_trip_is_bit_exact(make, kind):
    w = make(48, 96, seed=1)
    w[5, :32] = 0.25 if kind == Q4_1 else 0.0            # a constant block: d = 0
    packed = pack(w)
    assert packed is not None and packed.kind == kind and (packed.out_features, packed.in_features) == (48, 96)
    assert same_bits(unpack(packed), w)
    assert packed.nbytes < w.numel() * 4 / 3


def test_weights_that_are_not_quantized_stay_fp32():
    w = torch.randn(32, 64)
    assert pack(w) is None                               # plain fp32
    q = gguf_q4_1(32, 64, seed=2)
    q[3, 7] = torch.nextafter(q[3, 7], torch.tensor(1.0))   # one weight off its grid
    assert pack(q) is None
    assert pack(gguf_q4_1(24, 64, seed=3)) is None       # N not a multiple of 16
    assert pack(gguf_q4_1(32, 64, seed=3)[:, :48]) is None   # K not a multiple of 32
    assert pack(gguf_q4_1(32, 64, seed=3).double()) is None


@pytest.mark.parametrize("isa", build.runnable_isas())    # every build this CPU runs (vector widths 16, 8, 4)
# 48: a tail tile of 16 rows; 320: k chunks of the scratch tile (128 + 128 + 64 at 16 lanes, 256 + 64 at 8)
@pytest.mark.parametrize("n, k", [(48, 64), (64, 96), (16, 32), (32, 320)])
@pytest.mark.parametrize("make", [gguf_q4_1, gguf_q8_0])
def test_kernel_matches_matmul_and_is_batch_invariant(make, n, k, isa):
    w = make(n, k, seed=n + k)
    packed = pack(w)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(7))
    full = kernel.packed_linear(x, packed, num_threads=2, isa=isa)           # > 48 rows: the scratch-tile path
    ref = (x.double() @ w.double().T).float()
    torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5 * (k / 96) ** 0.5)     # fp32 rounding grows with k
    # 1 and 2 rows: registers only (Q4_1 slices side by side, 1-4 of them: n / lanes); from 3 rows the scratch
    # path's register blocks (8 or 6 rows), full and partial; every row bitwise as in the 70-row batch
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 32, 33, 40, 48, 49, 57, 64, 65):
        part = kernel.packed_linear(x[:m], packed, num_threads=1, isa=isa)
        assert same_bits(part, full[:m]), m
        if m > 1:
            assert same_bits(kernel.packed_linear(x[1:m], packed, num_threads=2, isa=isa), full[1:m]), m
    alone = kernel.packed_linear(x[12:13], packed, num_threads=2, isa=isa)
    assert same_bits(alone[0], full[12])
    assert kernel.packed_linear(x[:0], packed, 2, isa=isa).shape == (0, n)
    assert kernel.packed_linear(x[:21].view(3, 7, k), packed, 2, isa=isa).shape == (3, 7, n)


@pytest.mark.parametrize("isa", build.runnable_isas())
@pytest.mark.parametrize("make", [gguf_q4_1, gguf_q8_0])
def test_passes_over_the_weights_keep_each_rows_bits(make, isa):
    """x larger than a pass (512 KB: here 64 rows of k = 2048) goes over the weights in several passes of rows;
    each row still comes out bitwise as alone, and within fp32 rounding of the fp64 matmul."""
    w = make(32, 2048, seed=5)
    packed = pack(w)
    x = torch.randn(200, 2048, generator=torch.Generator().manual_seed(6))
    full = kernel.packed_linear(x, packed, num_threads=2, isa=isa)
    ref = (x.double() @ w.double().T).float()
    torch.testing.assert_close(full, ref, rtol=1e-5, atol=3e-6 * ref.abs().max().item())      # 2048-term fp32 sums
    for lo, hi in ((0, 1), (0, 7), (63, 130), (199, 200)):
        assert same_bits(kernel.packed_linear(x[lo:hi], packed, num_threads=1, isa=isa), full[lo:hi]), (lo, hi)


FMA_ISAS = [isa for isa in build.runnable_isas() if isa in ("avx512", "avx2")]


@pytest.mark.skipif(len(FMA_ISAS) < 2, reason="this CPU has no AVX-512: only the AVX2 build runs here")
@pytest.mark.parametrize("make", [gguf_q4_1, gguf_q8_0])
def test_avx2_build_gives_the_avx512_builds_bits(make):
    """8-lane and 16-lane vectors, other register blocks and pass sizes: each output is still one fma chain in k
    order, so an AVX2 host serves the very numbers an AVX-512 host does (the generic build has no fma: not here)."""
    w = make(96, 160, seed=11)
    packed = pack(w)
    x = torch.randn(300, 160, generator=torch.Generator().manual_seed(12))
    for m in (1, 2, 3, 4, 5, 8, 16, 33, 48, 49, 64, 300):
        wide, narrow = (kernel.packed_linear(x[:m], packed, 2, isa=isa) for isa in FMA_ISAS)
        assert same_bits(wide, narrow), m


def test_kernel_rejects_bad_input():
    packed = pack(gguf_q4_1(32, 64, seed=4))
    with pytest.raises(ValueError, match="fp32 CPU input"):
        kernel.packed_linear(torch.randn(2, 32), packed, 1)
    with pytest.raises(ValueError, match="fp32 CPU input"):
        kernel.packed_linear(torch.randn(2, 64, dtype=torch.float64), packed, 1)
    with pytest.raises(ValueError, match="contiguous fp32"):
        kernel.packed_linear(torch.randn(2, 64), packed, 1, out=torch.empty(2, 16))


def test_packed_linear_module_adds_bias():
    layer = PackedLinear(64, 32)
    layer.weight.data = gguf_q4_1(32, 64, seed=5)
    x = torch.randn(5, 64)
    expected = layer(x)                                  # still fp32: an nn.Linear until it is packed
    layer.use_packed(pack(layer.weight.data))
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)


def test_real_model_weights_pack_losslessly(model_dir):
    """Every linear weight of the default model (GGUF Q4_1 layers, Q8_0 embedding) packs and unpacks bit for bit."""
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        for name, kind in (("model.layers.0.self_attn.q_proj.weight", Q4_1), ("model.layers.7.mlp.down_proj.weight",
                                                                               Q4_1),
                           ("model.embed_tokens.weight", Q8_0)):
            w = f.get_tensor(name)
            packed = pack(w)
            assert packed is not None and packed.kind == kind, name
            assert same_bits(unpack(packed), w), name


def test_pack_linear_weights_packs_only_packable_layers():
    model = nn.Sequential(PackedLinear(64, 32, bias=True), nn.ReLU(), PackedLinear(32, 32, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(gguf_q4_1(32, 64, seed=6))
    x = torch.randn(3, 64)
    expected = model(x)
    summary = pack_linear_weights(model)
    assert summary.startswith("packed weights: packed in ") and "1 of 2 linear weights losslessly (1 Q4_1)" in summary
    assert model[0].packed is not None and model[0].weight is None                  # the fp32 copy is gone
    assert model[2].packed is None and model[2].weight is not None                  # random weights stay fp32
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="packed weight"):
        PackedLinear(64, 48, bias=False).use_packed(model[0].packed)


def test_worker_packs_the_default_model(runner):
    """The session's ModelRunner (CPU, fp32) runs every linear layer, lm_head included, on packed weights; the
    greedy-vs-transformers tests in this folder therefore check the kernel end to end."""
    model = runner.model
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m, PackedLinear) and m.packed is not None for m in linears)
    assert model.lm_head.packed.kind == Q8_0 and model.model.layers[0].mlp.down_proj.packed.kind == Q4_1
    from steploop.gpu_worker.model.cpu_ops import CpuOps
    assert model.model.layers[3].mlp.ops is CpuOps and model.rotary.ops is CpuOps    # and the C elementwise ops
    assert runner.sampler.argmax_rows is CpuOps.argmax_rows     # greedy rows: the C argmax
