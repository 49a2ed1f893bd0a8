"""services/common/lora_adapter.py: what a PEFT folder must be to be served, each refusal naming its problem."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from safetensors.numpy import save_file

from steploop.common.lora_adapter import LoraAdapterError, LoraModelShapes, read_adapter

SHAPES = LoraModelShapes.for_llama(num_layers=2, hidden=8, q_size=8, kv_size=4, intermediate=12)
PREFIX = "base_model.model.model.layers"


def write_adapter(folder, rank=4, alpha=8, targets=("q_proj", "v_proj"), config_extra=None, shapes=SHAPES,
                  layers=2):
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
              "bias": "none", **(config_extra or {})}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    tensors = {}
    for layer in range(layers):
        for t in targets:
            part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            i, o = shapes.targets[t]
            tensors[f"{PREFIX}.{layer}.{part}.{t}.lora_A.weight"] = np.ones((rank, i), np.float32)
            tensors[f"{PREFIX}.{layer}.{part}.{t}.lora_B.weight"] = np.ones((o, rank), np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_a_good_adapter_reads_with_its_scaling(tmp_path):
    spec = read_adapter(str(write_adapter(tmp_path / "a")), SHAPES, max_rank=16)
    assert (spec.rank, spec.scaling, spec.targets) == (4, 2.0, ("q_proj", "v_proj"))
    rs = read_adapter(str(write_adapter(tmp_path / "b", config_extra={"use_rslora": True})), SHAPES, 16)
    assert rs.scaling == pytest.approx(8 / math.sqrt(4))
    mlp = read_adapter(str(write_adapter(tmp_path / "c", targets=("gate_proj", "down_proj"))), SHAPES, 16)
    assert mlp.targets == ("gate_proj", "down_proj")


@pytest.mark.parametrize("make, words", [
    (lambda p: p / "nowhere", "does not exist"),
    (lambda p: write_adapter(p / "x", rank=32), "greater than max_lora_rank 16"),
    (lambda p: write_adapter(p / "x", config_extra={"use_dora": True}), "DoRA"),
    (lambda p: write_adapter(p / "x", config_extra={"bias": "all"}), "biases"),
    (lambda p: write_adapter(p / "x", rank=0), "r must be a positive integer"),
    (lambda p: write_adapter(p / "x", shapes=LoraModelShapes.for_llama(2, 16, 16, 8, 24)), "another base model"),
    (lambda p: write_adapter(p / "x", layers=3), "has 2 layers"),
])
def test_a_bad_adapter_is_refused_with_its_problem(tmp_path, make, words):
    with pytest.raises(LoraAdapterError, match=words):
        read_adapter(str(make(tmp_path)), SHAPES, max_rank=16)


def test_a_malformed_config_or_weights_file_is_refused(tmp_path):
    folder = write_adapter(tmp_path / "x")
    (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoraAdapterError, match="malformed"):
        read_adapter(str(folder), SHAPES, 16)
    folder = write_adapter(tmp_path / "y")
    (folder / "adapter_model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(LoraAdapterError, match="not a safetensors file"):
        read_adapter(str(folder), SHAPES, 16)
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(LoraAdapterError, match="has no adapter_model.safetensors") as err:
        read_adapter(str(folder), SHAPES, 16)
    assert err.value.not_found


def test_an_unsupported_target_is_refused(tmp_path):
    folder = write_adapter(tmp_path / "x")
    save_file({f"{PREFIX}.0.self_attn.rotary.lora_A.weight": np.ones((4, 8), np.float32),
               f"{PREFIX}.0.self_attn.rotary.lora_B.weight": np.ones((8, 4), np.float32)},
              str(folder / "adapter_model.safetensors"))
    with pytest.raises(LoraAdapterError, match="targets 'rotary', which is not supported"):
        read_adapter(str(folder), SHAPES, 16)
    save_file({"base_model.model.lm_head.lora_A.weight": np.ones((4, 8), np.float32)},
              str(folder / "adapter_model.safetensors"))
    with pytest.raises(LoraAdapterError, match="lm_head are not supported"):
        read_adapter(str(folder), SHAPES, 16)
