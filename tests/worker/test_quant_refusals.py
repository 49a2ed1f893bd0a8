"""A quantized checkpoint steploop cannot compute exactly stops the worker at start: exit code 2, the method or
tensor named, before any weight is read (no "loading weights" line) and so before anything is served."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from tests.worker.quant_models import Spec, build_quant_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory, model_dir):
    path, _ = build_quant_model("llama", Spec("gptq", 4, 32, False), tmp_path_factory.mktemp("gptq"), model_dir)
    return path


def _start_worker(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "steploop.gpu_worker", "--model", str(path), "--device", "cpu"],
                          check=False, capture_output=True, text=True, timeout=600)


def _edit_config(src, dst, **quant) -> None:
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {**cfg["quantization_config"], **quant}
    for file in src.iterdir():
        if file.name != "config.json":
            (dst / file.name).symlink_to(file)
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("quant, named", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method bitsandbytes is not supported"),
    ({"quant_method": "hqq"}, "quant_method hqq is not supported"),
    ({"quant_method": "gptq", "bits": 3}, "(gptq) bits=3 is not supported"),
    ({"group_size": 48}, "down_proj: quantization group_size 48 does not divide the layer's 256 input features"),
])
def test_refused_config_exits_2_before_any_weight(tmp_path, gptq_dir, quant, named):
    _edit_config(gptq_dir, tmp_path, **quant)
    proc = _start_worker(tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert named in proc.stderr and "loading weights" not in proc.stderr


def test_misshapen_tensor_exits_2_before_any_weight(tmp_path, gptq_dir):
    tensors = load_file(gptq_dir / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.scales"
    tensors[name] = tensors[name][:-1].contiguous()        # one group row short
    save_file(tensors, tmp_path / "model.safetensors")
    for file in gptq_dir.iterdir():
        if file.name != "model.safetensors":
            (tmp_path / file.name).symlink_to(file)
    proc = _start_worker(tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{name}: stored shape (7, 128), expected (8, 128)" in proc.stderr
    assert "loading weights" not in proc.stderr
