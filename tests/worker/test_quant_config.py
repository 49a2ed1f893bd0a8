"""quantization_config: what is read, and what is refused with a message naming the method or field (the worker
turns the ValueError into exit code 2 at start: test_quant_refusals.py)."""

from __future__ import annotations

import pytest

from steploop.gpu_worker.model.quant.config import FP8, INT, read_quant_config
from tests.worker.quant_models import Spec, quantization_config


@pytest.mark.parametrize("spec, described", [
    (Spec("gptq", 4, 128, True), "gptq int4 group 128 sym"),
    (Spec("gptq", 4, 32, False, desc_act=True), "gptq int4 group 32 asym act-order"),
    (Spec("gptq", 8, -1, True, v1=False), "gptq int8 per-channel sym"),
    (Spec("awq", 4, 64, False), "awq int4 group 64 asym"),
    (Spec("ct_int", 4, 32, True), "compressed-tensors int4 group 32 sym"),
    (Spec("ct_int", 8, -1, False), "compressed-tensors int8 per-channel asym"),
    (Spec("ct_fp8"), "compressed-tensors FP8 W8A8 (per-tensor weights)"),
    (Spec("ct_fp8", fp8_channel=True), "compressed-tensors FP8 W8A8 (per-channel weights)"),
])
def test_accepted_schemes(spec, described):
    scheme = read_quant_config(quantization_config(spec))
    assert scheme.describe() == described
    assert scheme.kind == (FP8 if spec.method == "ct_fp8" else INT)
    if spec.method == "gptq":
        assert scheme.zeros_minus_one == spec.v1


def _ct(**weights) -> dict:
    q = quantization_config(Spec("ct_int", 4, 32, True))
    q["config_groups"]["group_0"]["weights"].update(weights)
    return q


@pytest.mark.parametrize("quant, named", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    ({"quant_method": "hqq", "nbits": 4}, "hqq"),
    ({"quant_method": "mxfp4"}, "MXFP4"),
    ({"quant_method": "something_new"}, "'something_new'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
    ({"quant_method": "gptq", "bits": 2, "group_size": 128}, "bits=2"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size=0"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "checkpoint_format"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, "lm_head"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version='gemv'"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "bits=8"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point"),
    (_ct(num_bits=2), "int2"),
    (_ct(strategy="tensor"), "weights.strategy='tensor'"),
    (_ct(actorder="group"), "actorder"),
    ({**_ct(), "format": "naive-quantized",
      "config_groups": {"group_0": {**_ct()["config_groups"]["group_0"], "format": None}}}, "naive-quantized"),
    ({**_ct(), "sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config"),
    ({**_ct(), "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
])
def test_refused_schemes_name_what_is_refused(quant, named):
    with pytest.raises(ValueError) as err:
        read_quant_config(quant)
    assert named in str(err.value)


def test_fp8_with_static_activations_is_refused():
    q = quantization_config(Spec("ct_fp8"))
    q["config_groups"]["group_0"]["input_activations"].update(dynamic=False, strategy="tensor")
    with pytest.raises(ValueError, match="input_activations"):
        read_quant_config(q)


def test_compressed_tensors_accepts_the_written_config():
    """The test writer's quantization_config is one compressed-tensors itself parses."""
    from compressed_tensors.quantization import QuantizationConfig
    for spec in (Spec("ct_int", 4, 32, False), Spec("ct_int", 8, -1, True), Spec("ct_fp8", fp8_channel=True)):
        QuantizationConfig.model_validate(quantization_config(spec))
