"""Each format's reader against the format's own reference dequantization, the packed forms against it, and the
shape checks that refuse a file before any weight is used."""

from __future__ import annotations

import pytest
import torch

from steploop.gpu_worker.cpu_kernels import packed_linear as kernel
from steploop.gpu_worker.cpu_kernels.packed_weights import Q4_1, Q8_0, unpack
from steploop.gpu_worker.model.quant.config import read_quant_config
from steploop.gpu_worker.model.quant.formats import Shapes, dequantize, read_linear
from steploop.gpu_worker.model.quant.linear import QuantLinear, quantize_fp8_per_token
from steploop.gpu_worker.model.quant.packing import contiguous_groups, pack_int, packable
from tests.worker.quant_models import WRITERS, Spec, quantization_config, reference_dequantize

N, K = 96, 256
SPECS = [Spec("gptq", 4, 128, True), Spec("gptq", 4, 32, False, desc_act=True), Spec("gptq", 4, 64, False, v1=False),
         Spec("gptq", 4, -1, True), Spec("gptq", 8, 32, True), Spec("gptq", 8, -1, False, desc_act=False),
         Spec("gptq", 8, 64, True, desc_act=True), Spec("awq", 4, 128, False), Spec("awq", 4, 32, False),
         Spec("ct_int", 4, 32, True), Spec("ct_int", 4, 128, False), Spec("ct_int", 4, -1, False),
         Spec("ct_int", 8, -1, True), Spec("ct_int", 8, 64, False), Spec("ct_fp8"), Spec("ct_fp8", fp8_channel=True)]


def _stored(spec: Spec, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) * 0.05
    return w, WRITERS[spec.method](w, spec, gen)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.id)
def test_reader_equals_reference_dequantization(spec):
    w, stored = _stored(spec)
    want = reference_dequantize(stored, spec, N, K)
    got = dequantize(read_linear(read_quant_config(quantization_config(spec)), "layer", stored, N, K))
    assert torch.equal(got, want)
    # the writer quantizes: the reference weights are the originals within half a step of the coarsest scale
    step = (w.abs().max() * 2 / (2 ** spec.bits - 1)) if spec.method != "ct_fp8" else w.abs().max() / 8
    assert (want - w).abs().max() <= step


@pytest.mark.parametrize("bits", [4, 8])
def test_ct_packing_is_compressed_tensors_own(bits):
    """The test writer's pack_cols is compressed-tensors' pack_to_int32 (weights along K, zero points along N)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from tests.worker.quant_models import pack_cols, pack_rows
    signed = torch.randint(-2 ** (bits - 1), 2 ** (bits - 1), (N, K), dtype=torch.int8)
    assert torch.equal(pack_to_int32(signed, bits), pack_cols(signed.long() + 2 ** (bits - 1), bits))
    assert torch.equal(pack_to_int32(signed, bits, packed_dim=0), pack_rows(signed.long() + 2 ** (bits - 1), bits))


@pytest.mark.parametrize("spec", [s for s in SPECS if s.method != "ct_fp8"], ids=lambda s: s.id)
def test_packed_form_is_the_reference_weight(spec):
    """Q4_1 (d * q + m, m = -scale * zero: one more fp32 rounding) and Q8_0 (bit for bit) hold the reference."""
    _, stored = _stored(spec)
    scheme = read_quant_config(quantization_config(spec))
    weight = read_linear(scheme, "layer", stored, N, K)
    plain, perm = contiguous_groups(weight)
    want = reference_dequantize(stored, spec, N, K)
    want = want if perm is None else want[:, perm]
    if not packable(plain):
        assert spec.bits == 8 and not spec.sym     # asymmetric int8: the torch path
        return
    packed = pack_int(plain)
    assert packed.kind == (Q4_1 if spec.bits == 4 else Q8_0)
    if spec.bits == 8:
        assert torch.equal(unpack(packed), want)
    else:
        torch.testing.assert_close(unpack(packed), want, rtol=0, atol=2e-7 * float(want.abs().max()))


@pytest.mark.parametrize("use_c", [True, False])
@pytest.mark.parametrize("spec", [Spec("gptq", 4, 32, False, desc_act=True), Spec("ct_int", 8, -1, True),
                                  Spec("gptq", 8, 64, False), Spec("ct_fp8", fp8_channel=True)], ids=lambda s: s.id)
def test_quant_linear_matches_reference(spec, use_c):
    """Two parts (as q and k of a fused qkv_proj), C packed or torch: the reference computation."""
    if use_c and not kernel.available():
        pytest.skip("the C kernels did not build here")
    scheme = read_quant_config(quantization_config(spec))
    layer = QuantLinear(K, 2 * N, False, ["a", "b"])
    refs = []
    for seed, part in enumerate(("a", "b")):
        _, stored = _stored(spec, seed)
        layer.loaded[part] = read_linear(scheme, part, stored, N, K)
        refs.append(reference_dequantize(stored, spec, N, K))
    layer.finish(torch.device("cpu"), use_c)
    x = torch.randn(5, K)
    if spec.method == "ct_fp8":     # the reference: compressed-tensors' dynamic token fake quantization of x
        from compressed_tensors.quantization import QuantizationArgs
        from compressed_tensors.quantization.lifecycle.forward import fake_quantize
        from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp
        args = QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=True, strategy="token")
        x3 = x[None]
        scale, zp = compute_dynamic_scales_and_zp(value=x3, args=args, module=None)
        want = fake_quantize(x=x3, scale=scale, zero_point=zp, args=args)[0] @ torch.cat(refs).T
    else:
        want = x @ torch.cat(refs).T
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    assert not hasattr(layer, "weight")          # no fp32 copy of the weight
    assert layer.nbytes < 2 * N * K * 4 / 2.5


def test_fp8_per_token_scales():
    x = torch.tensor([[1.0, -896.0, 3.0], [0.0, 0.0, 0.0]])
    q, scale = quantize_fp8_per_token(x)
    assert scale[0, 0] == 2.0 and scale[1, 0] == torch.finfo(torch.float32).eps
    assert q.float()[0].tolist() == [0.5, -448.0, 1.5] and q.float()[1].tolist() == [0.0] * 3


def test_group_size_that_does_not_divide_the_layer_is_refused():
    scheme = read_quant_config({"quant_method": "gptq", "bits": 4, "group_size": 48})
    with pytest.raises(ValueError, match="group_size 48 does not divide the layer's 256 input features"):
        Shapes(scheme, "model.layers.0.mlp.down_proj", N, K)


@pytest.mark.parametrize("spec, tensor, shape", [
    (Spec("gptq", 4, 128, True), "qweight", (K // 8 + 1, N)),
    (Spec("gptq", 4, 128, True), "scales", (K // 64, N)),
    (Spec("awq", 4, 128, False), "qzeros", (K // 128, N)),
    (Spec("ct_int", 4, 32, True), "weight_scale", (N, 1)),
    (Spec("ct_fp8", fp8_channel=True), "weight_scale", (1,)),
])
def test_misshapen_tensor_is_refused(spec, tensor, shape):
    _, stored = _stored(spec)
    shapes = {t: tuple(v.shape) for t, v in stored.items()}
    shapes[tensor] = shape
    scheme = read_quant_config(quantization_config(spec))
    with pytest.raises(ValueError, match=rf"layer\.{tensor}: stored shape"):
        Shapes(scheme, "layer", N, K).check(shapes)


def test_missing_tensor_is_refused():
    _, stored = _stored(Spec("gptq", 4, 128, True))
    del stored["qzeros"]
    scheme = read_quant_config(quantization_config(Spec("gptq", 4, 128, True)))
    with pytest.raises(ValueError, match="lacks qzeros"):
        Shapes(scheme, "layer", N, K).check({t: tuple(v.shape) for t, v in stored.items()})


def test_act_order_with_uneven_groups_is_refused():
    spec = Spec("gptq", 4, 32, False, desc_act=True)
    _, stored = _stored(spec)
    stored["g_idx"] = torch.zeros(K, dtype=torch.int32)
    with pytest.raises(ValueError, match="g_idx does not give each of the 8 groups 32 input columns"):
        read_linear(read_quant_config(quantization_config(spec)), "layer", stored, N, K)
