"""The kernel plan (kernel_plan.py): one frozen decision per worker from its flags, the STEPLOOP_CPU_* switches, the
device and the model's shapes; every switch turns off its feature (and what depends on it) with the reason; a model
built from a plan has the plan's ops and linear type in every layer from construction."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from steploop.common import envs
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.kernel_plan import KernelPlan, resolve_kernel_plan
from steploop.gpu_worker.model.cpu_ops import CpuOps
from steploop.gpu_worker.model.ops import TorchOps, TritonOps
from steploop.gpu_worker.model.packed_linear_layer import PackedLinear
from tests.worker.c_kernels import needs_c_kernels
from tests.worker.test_cpu_paged_attention import TINY

CPU = torch.device("cpu")
SWITCHES = (envs.CPU_KERNELS, envs.CPU_PACKED_WEIGHTS, envs.CPU_DECODER, envs.CPU_ATTENTION_KERNEL, envs.CPU_HUGEPAGES)
needs_kernels = needs_c_kernels()


@pytest.fixture(autouse=True)
def no_switches(monkeypatch):
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(envs.CPU_KERNEL_PROBE, "0")       # timed choices: tests/worker/test_kernel_probe.py


def plan_for(dtype=torch.float32, device=CPU, **flags) -> KernelPlan:
    return resolve_kernel_plan(WorkerConfig(device=device.type, **flags), device, dtype, TINY)


@needs_kernels
def test_cpu_fp32_runs_every_c_kernel():
    plan = plan_for()
    assert plan == KernelPlan("torch", "cpu", packed_linears=True, cpu_attention_kernel=True, cpu_decoder=True,
                              hugepages=True)
    assert plan.ops is CpuOps and isinstance(plan.linear(64, 32, False), PackedLinear)
    assert plan.describe() == ("attention torch + C paged kernel, elementwise cpu, packed linears, C decoder, "
                               "huge pages")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.packed_linears = False


@needs_kernels
@pytest.mark.parametrize("switch, off", [
    (envs.CPU_KERNELS, {"C elementwise ops", "packed linears", "C attention kernel", "C decoder"}),
    (envs.CPU_PACKED_WEIGHTS, {"packed linears", "C decoder"}),
    (envs.CPU_ATTENTION_KERNEL, {"C attention kernel", "C decoder"}),
    (envs.CPU_DECODER, {"C decoder"}),
    (envs.CPU_HUGEPAGES, {"huge pages"}),
])
def test_each_switch_turns_off_its_feature_and_what_needs_it(monkeypatch, switch, off):
    monkeypatch.setenv(switch, "0")
    plan = plan_for()
    why = dict(plan.why_off)
    assert set(why) == off
    assert all(reason == f"{switch}=0" or reason.startswith("no ") for reason in why.values())
    on = {"C elementwise ops": plan.elementwise == "cpu", "packed linears": plan.packed_linears,
          "C attention kernel": plan.cpu_attention_kernel, "C decoder": plan.cpu_decoder,
          "huge pages": plan.hugepages}
    assert {feature for feature, flag in on.items() if not flag} == off
    assert f"no {sorted(off)[0]}: " in plan.describe()


def test_other_dtypes_and_devices():
    bf16 = plan_for(torch.bfloat16)
    assert (bf16.elementwise, bf16.packed_linears, bf16.cpu_decoder, bf16.hugepages) == ("torch", False, False, True)
    assert "fp32 only (--dtype bfloat16)" in dict(bf16.why_off)["packed linears"]
    cuda = plan_for(device=torch.device("cuda", 0))
    assert cuda == KernelPlan("triton", "triton", cuda_graphs=True) and cuda.ops is TritonOps
    assert plan_for(device=torch.device("cuda", 0), attention_backend="torch", cuda_graphs=True) == KernelPlan()
    assert type(KernelPlan().linear(64, 32, True)) is nn.Linear and KernelPlan().ops is TorchOps


@needs_kernels
def test_triton_on_the_cpu_keeps_packed_linears(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    plan = plan_for(attention_backend="triton")
    assert (plan.attention_backend, plan.elementwise, plan.packed_linears) == ("triton", "triton", True)
    assert not plan.cpu_attention_kernel and not plan.cpu_decoder
    assert "the triton attention backend has its own kernels" in dict(plan.why_off)["C attention kernel"]


def test_impossible_plans_are_refused():
    with pytest.raises(ValueError, match="C decoder needs"):
        KernelPlan(cpu_decoder=True)
    with pytest.raises(ValueError, match="not one of"):
        KernelPlan(elementwise="avx")


def test_reference_plan():
    assert KernelPlan.reference() == KernelPlan() and KernelPlan.reference("triton").ops is TritonOps
