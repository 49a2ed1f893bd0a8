"""Quantized mixture-of-experts checkpoints (GPTQ, AWQ, compressed-tensors) served at their stored width: every
expert's projections (and Qwen2-MoE's shared expert) one QuantLinear each, no fp32 expert stack, greedy tokens equal
to transformers fp32 on each format's reference dequantization and logprobs within 1e-4, chunked and preempted;
experts quantized only in part are refused before any weight is read."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.model.moe import SparseMoE
from steploop.gpu_worker.model.quant.linear import QuantLinear
from steploop.gpu_worker.model_runner import ModelRunner
from tests.worker.quant_models import Spec, build_quant_model
from tests.worker.test_families import oracle, prompts, serve

pytestmark = pytest.mark.slow     # a few seconds per model

CASES = [("qwen3_moe", Spec("gptq", 4, 32, True, desc_act=True)), ("qwen2_moe", Spec("awq", 4, 32, False)),
         ("mixtral", Spec("ct_int", 4, 32, False)), ("qwen3_moe", Spec("ct_int", 8, -1, True)),
         ("mixtral", Spec("gptq", 8, 32, False, v1=False))]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1].id}")
def served(request, tmp_path_factory, model_dir):
    family, spec = request.param
    path, hf_model = build_quant_model(family, spec, tmp_path_factory.mktemp(f"{family}-{spec.id}"), model_dir)
    runner = ModelRunner.from_config(WorkerConfig(model=str(path), num_kv_blocks=64, max_model_len=256,
                                                  device="cpu"), path)
    return request.param, runner, [oracle(hf_model, p) for p in prompts()]


@pytest.mark.parametrize("chunk, preempt_after", [(512, None), (16, 8)])
def test_greedy_tokens_and_logprobs_equal_transformers(served, chunk, preempt_after):
    (family, spec), runner, expected = served
    got = serve(runner, chunk, preempt_after)
    for handle, (want_tokens, want_logprobs) in enumerate(expected):
        tokens, logprobs = got[handle]
        assert tokens == want_tokens, f"{family} {spec.id} prompt {handle}"
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4), f"{family} {spec.id} prompt {handle}"


def test_experts_stay_quantized(served):
    (family, spec), runner, _ = served
    blocks = [m for m in runner.model.modules() if isinstance(m, SparseMoE)]
    assert blocks
    for block in blocks:
        assert block.w13 is None and block.w2 is None                        # no fp32 expert stack
        experts = block.packed_experts["w13"] + block.packed_experts["w2"]
        assert len(experts) == 2 * block.spec.held_experts and all(isinstance(e, QuantLinear) for e in experts)
        if block.spec.shared_intermediate_size:
            assert isinstance(block.packed_experts["shared_w13"], QuantLinear) and block.shared_w13 is None
        fp32 = sum(e.in_features * e.out_features * 4 for e in experts)
        assert sum(e.nbytes for e in experts) < (0.3 if spec.bits == 4 else 0.4) * fp32


def test_experts_quantized_in_part_are_refused(tmp_path, model_dir):
    path, _ = build_quant_model("qwen3_moe", Spec("gptq", 4, 32, True), tmp_path / "q", model_dir)
    tensors = load_file(path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    expert = "model.layers.0.mlp.experts.2.up_proj"
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):
        tensors.pop(f"{expert}.{suffix}", None)
    tensors[f"{expert}.weight"] = torch.zeros(config["moe_intermediate_size"], config["hidden_size"])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="expert 2's parts are quantized only in part"):
        ModelRunner.from_config(WorkerConfig(model=str(path), num_kv_blocks=64, max_model_len=256, device="cpu"),
                                path)


def test_tensor_parallel_quantized_experts_are_refused_before_loading(tmp_path, model_dir):
    from steploop.gpu_worker.distributed.shapes import TensorParallelShapeError, rank_share
    from steploop.gpu_worker.distributed.stored_split import check_stored_split
    from steploop.gpu_worker.model.model_config import LlamaModelConfig

    path, _ = build_quant_model("mixtral", Spec("gptq", 4, 32, True), tmp_path / "m", model_dir)
    cfg = LlamaModelConfig.from_dir(path)
    for ep in (False, True):
        with pytest.raises(TensorParallelShapeError, match="-tp 2 with a quantized mixture-of-experts checkpoint"):
            check_stored_split(path, cfg, rank_share(cfg, 1, 2, expert_parallel=ep))
