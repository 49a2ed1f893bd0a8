"""The opt-in int8-activation kernels (cpu_kernels/int8_activations.c) for GGUF Q4_K, Q6_K, Q4_1 and Q8_0 weights
(the last two: the default model's layers and its tied embedding / lm_head): llama.cpp's
arithmetic (x rounded to int8 per 32, integer products), checked against a float64 reference of that very
arithmetic, for batch invariance and for the same bits in every build; and how far it is from the exact kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from steploop.gpu_worker.cpu_kernels import build
from steploop.gpu_worker.cpu_kernels import packed_linear as kernel
from steploop.gpu_worker.cpu_kernels.packed_weights import unpack
from steploop.gpu_worker.gguf import blocks
from steploop.gpu_worker.gguf.packed_forms import common_form, to_packed
from tests.worker.c_kernels import needs_c_kernels
from tests.worker.test_gguf_blocks import gguf_tensor, same_bits

ISAS = build.runnable_isas()


def quantized_x(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(xq, dx per 32) as the C code rounds: dx = max|x| / 127 in fp32, xq = roundf(x * (1 / dx)) (half away)."""
    m, k = x.shape
    blocks32 = x.astype(np.float32).reshape(m, k // 32, 32)
    d = (np.abs(blocks32).max(axis=2) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    v = (blocks32 * inv[:, :, None]).astype(np.float32).astype(np.float64)
    q = np.clip(np.sign(v) * np.floor(np.abs(v) + 0.5), -127, 127)
    return q.reshape(m, k), d.astype(np.float64)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64: sum over blocks of dx * sum(w * xq); w the file's dequantized weights (exactly d sc q - dmin mn up to
    their one fp32 rounding)."""
    xq, dx = quantized_x(x.numpy())
    m, k = xq.shape
    wb = w.double().numpy().reshape(w.shape[0], k // 32, 32)
    per_block = np.einsum("mbk,nbk->mnb", xq.reshape(m, k // 32, 32), wb)
    return torch.from_numpy((per_block * dx[:, None, :]).sum(axis=2))


def packed_weight(qtype: T, n: int = 48, k: int = 512, seed: int = 5):
    raw = gguf_tensor(qtype, n, k, seed=seed)
    packed = to_packed([blocks.decode(raw, qtype, k)], common_form([qtype]), [qtype])
    return packed, unpack(packed)


@pytest.fixture
def int8_on():
    for isa in ISAS:
        kernel.set_int8_activations(True, isa=isa)
    yield
    for isa in ISAS:
        kernel.set_int8_activations(False, isa=isa)


# (type, K): the 32-blocks' forms also at the default model's K = 576 (not a multiple of 256)
FORMS = [(T.Q4_K, 512), (T.Q6_K, 512), (T.Q4_1, 576), (T.Q8_0, 576), (T.Q8_0, 512)]


@needs_c_kernels(ISAS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype,k", FORMS, ids=lambda v: getattr(v, "name", str(v)))
def test_int8_kernels_compute_llama_cpps_arithmetic_batch_invariant_in_every_build(qtype, k, isa, int8_on):
    packed, w = packed_weight(qtype, k=k)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(1))
    x[3, :64] = 0.0                                                   # an all-zero block: dx = 0
    x[5, 100] = 40.0                                                  # an outlier: the rest of its block rounds coarsely
    halves = [127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, -0.49999997, 126.5, -126.5, 63.5, 0.0]
    x[7, :len(halves)] = torch.tensor(halves)       # dx = 1 exactly: ties round away from zero, as roundf (every build)
    x[7, len(halves):32] = 0.25
    full = kernel.packed_linear(x, packed, num_threads=2, isa=isa)
    ref = reference(x, w)
    torch.testing.assert_close(full.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    for m in (1, 2, 3, 17, 64, 65):                                   # 64 rows: one pass over a group's weights
        assert same_bits(kernel.packed_linear(x[:m], packed, num_threads=1, isa=isa), full[:m]), m
        assert same_bits(kernel.packed_linear(x[m:m + 1], packed, num_threads=2, isa=isa), full[m:m + 1]), m
    for other in ISAS:                                                # AVX2 intrinsics and portable C alike
        assert same_bits(kernel.packed_linear(x, packed, num_threads=2, isa=other), full), other


@needs_c_kernels(ISAS)
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_int8_activations_are_close_to_the_exact_kernels_and_switch_off(qtype):
    packed, w = packed_weight(qtype, n=64, k=1024)
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(2))
    exact = kernel.packed_linear(x, packed, num_threads=2)
    kernel.set_int8_activations(True)
    try:
        rounded = kernel.packed_linear(x, packed, num_threads=2)
    finally:
        kernel.set_int8_activations(False)
    err = (rounded - exact).norm() / exact.norm()
    assert 1e-5 < err < 2e-2                  # int8 rounding of x: not exact, ~0.5% of the output's norm
    assert same_bits(kernel.packed_linear(x, packed, num_threads=2), exact)     # off: the exact kernels again


@needs_c_kernels(ISAS)
def test_a_q4_k_m_file_serves_with_int8_activations_alike_however_batched(tmp_path, model_dir, monkeypatch, caplog):
    from steploop.gpu_worker.config import WorkerConfig
    from steploop.gpu_worker.gguf_convert import convert_gguf
    from steploop.gpu_worker.model_runner import ModelRunner
    from tests.worker.gguf_files import random_model, write_gguf
    from tests.worker.test_families import serve
    from tests.worker.test_gguf_direct import _q4_k_m_types
    monkeypatch.setenv("STEPLOOP_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(random_model("LlamaConfig", tie_word_embeddings=False), tmp_path / "q4_k_m.gguf", model_dir,
                      qtype_of=_q4_k_m_types)
    folder = convert_gguf(path)

    def runner(int8: bool) -> ModelRunner:
        return ModelRunner.from_config(WorkerConfig(model=str(path), num_kv_blocks=64, max_model_len=256,
                                                    device="cpu", cpu_int8_activations=int8), folder)

    exact = serve(runner(False), 512)
    try:
        with caplog.at_level("WARNING"):
            rounded_runner = runner(True)
        assert "NOT equal to the fp32 reference" in caplog.text
        whole, chunked = serve(rounded_runner, 512), serve(rounded_runner, 16, preempt_after=8)
    finally:
        kernel.set_int8_activations(False)
    assert whole == chunked                      # batch, chunk and preemption invariant, as the exact kernels
    for handle, (tokens, logprobs) in exact.items():
        assert whole[handle] != (tokens, logprobs)                                     # not exact ...
        if whole[handle][0][0] == tokens[0]:     # ... but close: a random 2-layer model's first logprob moved
            assert abs(whole[handle][1][0] - logprobs[0]) < 0.3, handle       # by 0.11 at most here


@needs_c_kernels(ISAS)
def test_the_default_model_serves_with_int8_activations_alike_however_batched(runner, model_dir, caplog):
    """The default model's Q4_1 layers and Q8_0 lm_head take the int8 path: batch, chunk and preemption invariant,
    close to the exact kernels' tokens and logprobs, and the exact kernels again once it is off."""
    from steploop.gpu_worker.config import WorkerConfig
    from steploop.gpu_worker.model_runner import ModelRunner
    from tests.worker.test_families import serve

    exact = serve(runner, 512)
    try:
        with caplog.at_level("WARNING"):
            rounded_runner = ModelRunner.from_config(WorkerConfig(model=str(model_dir), num_kv_blocks=64,
                                                                  max_model_len=256, device="cpu",
                                                                  cpu_int8_activations=True), model_dir)
        assert " Q4_1" in caplog.text and " Q8_0" in caplog.text and "NOT equal" in caplog.text
        whole, chunked = serve(rounded_runner, 512), serve(rounded_runner, {0: 7, 1: 64, 2: 5}, preempt_after=8)
    finally:
        kernel.set_int8_activations(False)
    assert whole == chunked
    assert whole != exact                                      # not exact ...
    firsts = [h for h, (tokens, _) in exact.items() if whole[h][0][0] == tokens[0]]
    assert len(firsts) >= 2                                    # ... but close: first tokens (greedy diverges after),
    for handle in firsts:                                      # their logprobs 0.1-0.2 apart here
        assert abs(whole[handle][1][0] - exact[handle][1][0]) < 0.3, handle
    assert serve(runner, 512) == exact                         # off again: the exact kernels


def test_int8_activations_are_refused_where_they_would_change_nothing():
    from torch import nn

    from steploop.gpu_worker.kernel_plan import KernelPlan
    from steploop.gpu_worker.model_runner import _set_int8_activations
    with pytest.raises(ValueError, match="this worker has none"):
        _set_int8_activations(True, nn.Linear(32, 16), KernelPlan(packed_linears=True))
    with pytest.raises(ValueError, match="no packed linears"):
        _set_int8_activations(True, nn.Linear(32, 16), KernelPlan())
