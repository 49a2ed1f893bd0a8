"""The C elementwise ops (cpu_kernels/elementwise.c via model/cpu_ops.py's CpuOps) against TorchOps, the reference:
RMSNorm (+ residual), rotary and SiLU-and-mul, in place where the interface says so, rows independent of the batch."""

from __future__ import annotations

import pytest
import torch

from steploop.common import envs
from steploop.gpu_worker.cpu_kernels import elementwise as kernel
from steploop.gpu_worker.model.cpu_ops import CpuOps
from steploop.gpu_worker.model.ops import TorchOps
from steploop.gpu_worker.model.rotary import RotaryEmbedding
from tests.worker.c_kernels import needs_c_kernels

pytestmark = needs_c_kernels()


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("t, h", [(1, 576), (16, 576), (40, 64), (3, 100)])     # 100: not a multiple of 16
def test_rms_norm_matches_torch(t, h):
    x, res, w = rand(t, h, seed=1), rand(t, h, seed=2), rand(h, seed=3)
    want_y, want_res = TorchOps.rms_norm(x.clone(), w, 1e-5, res.clone())
    x2, res2 = x.clone(), res.clone()
    y, new_res = CpuOps.rms_norm(x2, w, 1e-5, res2)
    assert y.data_ptr() == x2.data_ptr() and new_res.data_ptr() == res2.data_ptr()     # in place, like triton
    assert torch.equal(new_res, want_res)                              # the residual add rounds as torch's
    torch.testing.assert_close(y, want_y, rtol=2e-6, atol=1e-6)        # only the sum of squares' order differs
    plain = CpuOps.rms_norm(x, w, 1e-5)                                # no residual: x is kept (layer 0 needs it)
    assert torch.equal(x, rand(t, h, seed=1))
    torch.testing.assert_close(plain, TorchOps.rms_norm(x, w, 1e-5), rtol=2e-6, atol=1e-6)
    assert torch.equal(CpuOps.rms_norm(x[-1:].clone(), w, 1e-5), plain[-1:])      # a row alone: same bits


def test_rotary_matches_torch_bit_for_bit_on_qkv_slices():
    rope = RotaryEmbedding(64, 300, 10000.0, None)
    rope.build_cache(torch.device("cpu"), torch.float32)
    t, hq, hk = 12, 9, 3
    qkv = rand(t, (hq + 2 * hk) * 64, seed=4)
    positions = torch.tensor([0, 1, 2, 299, 5, 17, 40, 41, 100, 7, 8, 250])
    q, k, _ = qkv.split([hq * 64, hk * 64, hk * 64], dim=-1)
    q, k = q.view(t, hq, 64), k.view(t, hk, 64)                        # strided views, as the model makes them
    want_q, want_k = TorchOps.rotary(positions, q.clone(), k.clone(), rope.cos, rope.sin)
    v_before = qkv[:, -hk * 64:].clone()
    got_q, got_k = CpuOps.rotary(positions, q, k, rope.cos, rope.sin)
    assert got_q.data_ptr() == q.data_ptr()                           # in place
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(qkv[:, -hk * 64:], v_before)                    # v untouched
    with pytest.raises(ValueError, match="position"):
        kernel.rotary(torch.tensor([300] * t), q, k, rope.cos, rope.sin)


@pytest.mark.parametrize("t, inter", [(1, 1536), (16, 1536), (5, 40)])     # 40: a tail of 8 lanes
def test_silu_and_mul_matches_torch(t, inter):
    x = rand(t, 2 * inter, seed=5) * 4
    x[0, :3] = torch.tensor([-120.0, 90.0, 0.0])                       # exp's clamps
    got = CpuOps.silu_and_mul(x)
    torch.testing.assert_close(got, TorchOps.silu_and_mul(x), rtol=1e-5, atol=1e-6)
    assert torch.equal(CpuOps.silu_and_mul(x[-1:]), got[-1:])          # a row alone: same bits


def test_argmax_rows_is_torch_argmax():
    """Greedy sampling's argmax: the first maximum, a NaN counting as the largest, -inf rows, ties, tails that are not
    a whole vector; other dtypes and strided rows go to torch."""
    x = rand(9, 1000)
    x[1, 7] = x[1, 993] = 50.0                 # a tie: the first
    x[2, 999] = 60.0                           # in the tail past the last whole vector
    x[3, 500] = x[3, 20] = float("nan")        # the first NaN
    x[4] = float("-inf")
    x[5, 0] = float("inf")
    x[6, 3] = float("nan")
    x[6, 4] = float("inf")
    assert torch.equal(CpuOps.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(CpuOps.argmax_rows(x[:, :13]), x[:, :13].argmax(dim=-1))     # strided: torch's
    assert torch.equal(CpuOps.argmax_rows(x.double()), x.double().argmax(dim=-1))
    assert torch.equal(CpuOps.argmax_rows(x[2:3]), x[2:3].argmax(dim=-1))


def test_other_dtypes_fall_back_to_torch():
    x, w = rand(4, 64).double(), rand(64).double()
    torch.testing.assert_close(CpuOps.rms_norm(x, w, 1e-5), TorchOps.rms_norm(x, w, 1e-5))
    torch.testing.assert_close(CpuOps.silu_and_mul(x), TorchOps.silu_and_mul(x))


def test_the_plan_picks_the_c_ops_and_obeys_the_switch(monkeypatch):
    """A model built from a CPU fp32 plan has CpuOps in every layer from the start; STEPLOOP_CPU_KERNELS=0 gives
    a plan (and a model) of TorchOps."""
    from steploop.gpu_worker.attention.selector import create_backend
    from steploop.gpu_worker.config import WorkerConfig
    from steploop.gpu_worker.kernel_plan import resolve_kernel_plan
    from steploop.gpu_worker.model.llama import LlamaForCausalLM
    from tests.worker.test_cpu_paged_attention import TINY

    def built(ops):
        plan = resolve_kernel_plan(WorkerConfig(device="cpu"), torch.device("cpu"), torch.float32, TINY)
        with torch.device("meta"):
            model = LlamaForCausalLM(TINY, create_backend("torch", 6, 2, 64, 0.125), 128, plan)
        users = [m for m in model.modules() if hasattr(m, "ops")]
        assert len(users) == 2 * 3 + 1 + 1 and all(m.ops is ops for m in users)   # per layer 2 norms + MLP; norm; rotary
        return plan

    assert built(CpuOps).elementwise == "cpu"
    monkeypatch.setenv(envs.CPU_KERNELS, "0")
    plan = built(TorchOps)
    assert dict(plan.why_off)["C elementwise ops"] == "STEPLOOP_CPU_KERNELS=0" and not plan.packed_linears
