"""The start-up probe (cpu_kernels/probe.py): it times the packed matmul and torch's on the model's layer shapes,
keeps the faster (ties to the kernel), and the kernel plan follows it, naming both figures when torch wins."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from steploop.common import envs
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.cpu_kernels import probe
from steploop.gpu_worker.cpu_kernels.build import load
from steploop.gpu_worker.kernel_plan import resolve_kernel_plan
from steploop.gpu_worker.model.model_config import LlamaModelConfig
from tests.worker.c_kernels import needs_c_kernels
from tests.worker.test_cpu_paged_attention import TINY

needs_kernels = needs_c_kernels()


def result(packed_ms, torch_ms) -> probe.ProbeResult:
    return probe.ProbeResult((1, 64), tuple(packed_ms), tuple(torch_ms), 0.1)


def test_choice_is_the_geometric_mean_with_ties_to_the_kernel():
    assert result((1.0, 10.0), (2.0, 20.0)).speedup == pytest.approx(2.0)
    assert result((1.0, 10.0), (2.0, 20.0)).use_packed
    assert result((1.0, 40.0), (2.0, 20.0)).use_packed              # 2x faster at 1 row, 2x slower at 64: a tie
    assert result((1.05, 10.5), (1.0, 10.0)).use_packed             # within PREFER_TORCH
    assert not result((2.0, 200.0), (1.0, 20.0)).use_packed          # the AVX2 collapse: 10x slower at 64 rows
    text = result((2.0, 200.0), (1.0, 20.0)).describe()
    assert "1 rows 2.0 vs 1.0 ms" in text and "64 rows 200.0 vs 20.0 ms" in text


def test_layer_shapes_are_the_fused_linears(model_dir):
    cfg = LlamaModelConfig.from_dir(model_dir)          # SmolLM2-135M: 9 heads, 3 KV heads of 64, hidden 576
    assert probe.layer_shapes(cfg) == [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def test_shapes_the_packed_layout_cannot_hold_are_not_probed(monkeypatch):
    odd = dataclasses.replace(TINY, intermediate_size=136)          # down_proj: in_features 136, not a multiple of 32
    assert probe.layer_shapes(odd) == [(640, 384), (384, 384), (272, 384)]
    none_fit = dataclasses.replace(TINY, hidden_size=392, intermediate_size=136)    # none on the grid
    assert probe.layer_shapes(none_fit) == []
    for name in (envs.CPU_KERNELS, envs.CPU_PACKED_WEIGHTS, envs.CPU_KERNEL_PROBE):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(probe, "probe_packed_linear", lambda shapes: pytest.fail("probed nothing packable"))
    plan = resolve_kernel_plan(WorkerConfig(device="cpu"), torch.device("cpu"), torch.float32, none_fit)
    if load() is not None:
        assert not plan.packed_linears and "nothing to pack" in dict(plan.why_off)["packed linears"]


def test_a_big_models_layers_are_probed_at_a_bounded_size():
    weights, packed = probe._weights([(14336 * 2, 4096), (4096, 14336)])      # an 8B model's MLP: ~0.7 GB of fp32
    assert {tuple(w.shape) for w in weights} == {(4096, 4096)} and len(weights) == 2
    assert {(p.out_features, p.in_features) for p in packed} == {(4096, 4096)}


@needs_kernels
def test_probe_times_both_paths_and_restores_threads():
    threads = torch.get_num_threads()
    measured = probe.probe_packed_linear([(64, 128), (128, 64)], rows=(1, 8), rounds=1)
    assert measured.rows == (1, 8) and len(measured.packed_ms) == len(measured.torch_ms) == 2
    assert all(ms > 0 for ms in measured.packed_ms + measured.torch_ms) and measured.seconds > 0
    assert torch.get_num_threads() == threads


@needs_kernels
def test_plan_follows_the_probe(monkeypatch, caplog):
    monkeypatch.delenv(envs.CPU_KERNEL_PROBE, raising=False)
    for name in (envs.CPU_KERNELS, envs.CPU_PACKED_WEIGHTS, envs.CPU_DECODER, envs.CPU_ATTENTION_KERNEL):
        monkeypatch.delenv(name, raising=False)
    slow = result((2.0, 200.0), (1.0, 20.0))
    monkeypatch.setattr(probe, "probe_packed_linear", lambda shapes: slow)
    cpu = torch.device("cpu")
    plan = resolve_kernel_plan(WorkerConfig(device="cpu"), cpu, torch.float32, TINY)
    why = dict(plan.why_off)
    assert not plan.packed_linears and not plan.cpu_decoder and plan.elementwise == "cpu"
    assert why["packed linears"].startswith("torch is faster here") and "200.0 vs 20.0 ms" in why["packed linears"]
    fast = result((1.0, 10.0), (2.0, 20.0))
    monkeypatch.setattr(probe, "probe_packed_linear", lambda shapes: fast)
    with caplog.at_level("INFO"):
        assert resolve_kernel_plan(WorkerConfig(device="cpu"), cpu, torch.float32, TINY).packed_linears
    assert "packed linears: packed vs torch" in caplog.text                  # both figures logged either way
    monkeypatch.setenv(envs.CPU_KERNEL_PROBE, "0")
    monkeypatch.setattr(probe, "probe_packed_linear", lambda shapes: slow)
    assert resolve_kernel_plan(WorkerConfig(device="cpu"), cpu, torch.float32, TINY).packed_linears


@needs_kernels
def test_stored_quantized_weights_run_packed_whatever_the_probe_would_say(monkeypatch):
    """A GPTQ/AWQ/GGUF checkpoint has no fp32 copy: the probe (a timing, which a busy machine can tip) must not
    decide whether its layers and the C decoder run, nor widen its weights to fp32."""
    monkeypatch.delenv(envs.CPU_KERNEL_PROBE, raising=False)
    for name in (envs.CPU_KERNELS, envs.CPU_PACKED_WEIGHTS, envs.CPU_DECODER, envs.CPU_ATTENTION_KERNEL):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(probe, "probe_packed_linear", lambda shapes: pytest.fail("probed a quantized checkpoint"))
    plan = resolve_kernel_plan(WorkerConfig(device="cpu"), torch.device("cpu"), torch.float32, TINY,
                               stored_quantized=True)
    assert plan.packed_linears and plan.cpu_decoder
