"""16-bit checkpoints on the CPU (model/half_weights.py, packed_linear.c's steploop_packed_linear_w16): a bf16 or fp16
checkpoint's linears stay at 16 bits and are widened exactly to fp32 in the kernel. The widening gives back the
checkpoint's values bit for bit (subnormal, infinite and extreme halves included, on every build), the kernel matches
x @ W.T with each row independent of its batch, and a served model equals transformers fp32 on the same upcast
weights while its linears and embedding table hold half the fp32 bytes."""

from __future__ import annotations

import json

import pytest
import torch

from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.cpu_kernels import build
from steploop.gpu_worker.cpu_kernels import packed_linear as kernel
from steploop.gpu_worker.cpu_kernels.packed_weights import BF16, F16, pack_w16, unpack
from steploop.gpu_worker.model.half_weights import HalfEmbedding
from steploop.gpu_worker.model.packed_linear_layer import PackedLinear
from steploop.gpu_worker.model_runner import ModelRunner
from tests.worker.c_kernels import needs_c_kernels
from tests.worker.family_models import FAMILY_CONFIGS, build_family_model, load_oracle
from tests.worker.test_families import oracle, prompts, serve

pytestmark = needs_c_kernels(build.runnable_isas())

# every special fp16: the smallest subnormal, a larger one, the largest normal, infinities, signed zeros
HALF_EDGES = [2.0 ** -24, -(2.0 ** -24), 3 * 2.0 ** -20, 65504.0, -65504.0, float("inf"), float("-inf"), 0.0, -0.0,
              2.0 ** -14, 1.0, -1.5]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def random_weight(dtype: torch.dtype, n: int, k: int, seed: int) -> torch.Tensor:
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1).to(dtype)


@pytest.mark.parametrize("dtype, kind", [(torch.bfloat16, BF16), (torch.float16, F16)])
def test_pack_keeps_the_stored_bits(dtype, kind):
    w = random_weight(dtype, 48, 40, seed=1)
    w[2, :len(HALF_EDGES)] = torch.tensor(HALF_EDGES, dtype=dtype)
    packed = pack_w16(w)
    assert packed.kind == kind and packed.nbytes == w.numel() * 2
    assert same_bits(unpack(packed), w.float())
    assert pack_w16(random_weight(dtype, 24, 40, seed=2)) is None         # not whole groups of 16 rows
    assert pack_w16(torch.randn(32, 40)) is None                          # fp32: not a 16-bit checkpoint


@pytest.mark.parametrize("isa", build.runnable_isas())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_widens_every_value_exactly(dtype, isa):
    """x = the identity: each output is one weight times 1 plus zeros, so y = W.T exactly (the kernel's own fp16
    conversion, vcvtph2ps or the generic build's integer one, against torch's)."""
    k = len(HALF_EDGES) + 4
    w = random_weight(dtype, 32, k, seed=3)
    w[5, :len(HALF_EDGES)] = torch.tensor(HALF_EDGES, dtype=dtype)
    w[5, :len(HALF_EDGES)] = w[5, :len(HALF_EDGES)].nan_to_num(posinf=7.0, neginf=-7.0)   # 0 * inf: NaN (below)
    packed = pack_w16(w)
    for rows in (1, 2, k):      # the register path (1, 2 rows) and the scratch tile
        y = kernel.packed_linear(torch.eye(k)[:rows], packed, num_threads=2, isa=isa)
        assert torch.equal(y, w.float().T[:rows]), rows
    inf = torch.zeros(16, 8, dtype=dtype)         # infinities where x is 1 (elsewhere 0 * inf would be NaN)
    inf[3, 0], inf[4, 0] = float("inf"), float("-inf")
    y = kernel.packed_linear(torch.eye(8)[:1], pack_w16(inf), num_threads=1, isa=isa)
    assert y[0, 3] == float("inf") and y[0, 4] == float("-inf") and not y[0, 5:].any()


@pytest.mark.parametrize("isa", build.runnable_isas())
@pytest.mark.parametrize("n, k", [(48, 64), (32, 200), (64, 331)])     # k: chunk tails, and not a multiple of 32
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_matmul_and_is_batch_invariant(dtype, n, k, isa):
    w = random_weight(dtype, n, k, seed=n + k)
    packed = pack_w16(w)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(7))
    full = kernel.packed_linear(x, packed, num_threads=2, isa=isa)
    ref = (x.double() @ w.double().T).float()
    torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5 * (k / 96) ** 0.5)
    for m in (1, 2, 3, 5, 8, 9, 17, 33, 64, 69):
        assert same_bits(kernel.packed_linear(x[:m], packed, num_threads=1, isa=isa), full[:m]), m
        assert same_bits(kernel.packed_linear(x[1:m + 1], packed, num_threads=2, isa=isa), full[1:m + 1]), m
    if isa == "avx2" and "avx512" in build.runnable_isas():      # the vector width does not change a bit
        assert same_bits(full, kernel.packed_linear(x, packed, num_threads=2, isa="avx512"))


def _half_linears(runner) -> list[PackedLinear]:
    return [m for m in runner.model.modules() if isinstance(m, PackedLinear) and m.packed is not None
            and m.packed.kind in (BF16, F16)]


# a plain Llama (SiLU, no window): every layer in the C decoder's one call per step, its linears 16-bit
PLAIN_LLAMA = ("LlamaConfig", {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                               "tie_word_embeddings": False})


@pytest.mark.slow
@pytest.mark.parametrize("family, dtype, shard", [("llama", torch.bfloat16, "5GB"),
                                                  ("qwen2", torch.float16, "2MB")])
def test_served_model_equals_transformers_and_holds_16_bits(tmp_path, model_dir, monkeypatch, family, dtype, shard):
    """llama: untied lm_head (16-bit too), the C decoder; qwen2: q/k/v biases (layer by layer), a tied table (one
    16-bit tensor for the lookups and the logits), fp16 in shards of 2 MB (q, k, v and gate, up split across files).
    Greedy tokens and logprobs (1e-4) as transformers fp32 on the upcast weights, whole-prompt and chunked with a
    preemption."""
    monkeypatch.setitem(FAMILY_CONFIGS, "llama", PLAIN_LLAMA)
    path = build_family_model(family, tmp_path, model_dir, dtype=dtype, max_shard_size=shard)
    runner = ModelRunner.from_config(WorkerConfig(model=str(path), num_kv_blocks=64, max_model_len=256,
                                                  device="cpu"), path)
    cfg = runner.model.config
    half = _half_linears(runner)
    assert len(half) == 4 * cfg.num_hidden_layers + 1      # and lm_head: its own, or a copy of the tied table
    assert all(m.weight is None and m.packed.kind == (BF16 if dtype == torch.bfloat16 else F16) for m in half)
    assert sum(m.packed.nbytes for m in half) == sum(2 * m.in_features * m.out_features for m in half)
    table = runner.model.model.embed_tokens
    assert isinstance(table, HalfEmbedding) and not list(table.parameters()) and table.packed.nbytes == \
        2 * cfg.vocab_size * cfg.hidden_size                   # the table at 16 bits too, no fp32 copy
    assert (runner.model.lm_head.packed is table.packed) == bool(cfg.tie_word_embeddings)     # tied: the same rows
    assert (runner.model.cpu_decoder is not None) == (family == "llama")
    hf_model = load_oracle(path)
    expected = [oracle(hf_model, p) for p in prompts()]
    for chunk, preempt_after in ((512, None), (16, 8)):
        got = serve(runner, chunk, preempt_after)
        for handle, (want_tokens, want_logprobs) in enumerate(expected):
            tokens, logprobs = got[handle]
            assert tokens == want_tokens, (chunk, handle)
            assert logprobs == pytest.approx(want_logprobs, abs=1e-4), (chunk, handle)


@pytest.mark.slow
def test_fp32_and_mixed_layers_stay_fp32(tmp_path, model_dir):
    """A layer whose parts are fp32, or mix bf16 with fp32, keeps an fp32 weight; the rest of the checkpoint is held
    at 16 bits. Same tokens as transformers either way."""
    from safetensors.torch import load_file, save_file
    path = build_family_model("llama_gelu", tmp_path, model_dir, dtype=torch.bfloat16)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"].float()
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"].float()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    runner = ModelRunner.from_config(WorkerConfig(model=str(path), num_kv_blocks=64, max_model_len=256,
                                                  device="cpu"), path)
    layers = runner.model.model.layers
    assert layers[0].self_attn.qkv_proj.packed is None and layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    assert layers[1].mlp.down_proj.packed is None
    assert layers[0].self_attn.o_proj.packed.kind == BF16 and layers[1].mlp.gate_up_proj.packed.kind == BF16
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    got = serve(runner, 512)
    hf_model = load_oracle(path)
    for handle, prompt in enumerate(prompts()):
        assert got[handle][0] == oracle(hf_model, prompt)[0]


def test_no_start_up_probe_for_a_16_bit_checkpoint(tmp_path, model_dir, monkeypatch):
    """As for quantized weights, a bf16 checkpoint is not timed against an fp32 copy of itself (the probe could turn
    packed linears off and double the weights): the probe is never called, and the linears are 16-bit."""
    from steploop.common import envs
    from steploop.gpu_worker.cpu_kernels import probe

    def no_probe(*args, **kwargs):
        raise AssertionError("the packed-linear probe ran for a 16-bit checkpoint")

    monkeypatch.setenv(envs.CPU_KERNEL_PROBE, "1")
    monkeypatch.setattr(probe, "probe_packed_linear", no_probe)
    monkeypatch.setitem(FAMILY_CONFIGS, "llama", PLAIN_LLAMA)
    path = build_family_model("llama", tmp_path, model_dir, dtype=torch.bfloat16)
    runner = ModelRunner.from_config(WorkerConfig(model=str(path), num_kv_blocks=16, max_model_len=128,
                                                  device="cpu"), path)
    assert len(_half_linears(runner)) == 4 * runner.model.config.num_hidden_layers + 1


def test_a_misshapen_16_bit_tensor_is_refused_by_name(tmp_path, model_dir, monkeypatch):
    """A bf16 o_proj of the wrong shape stops the load with the tensor's name and both shapes, before serving."""
    from safetensors.torch import load_file, save_file
    monkeypatch.setitem(FAMILY_CONFIGS, "llama", PLAIN_LLAMA)
    path = build_family_model("llama", tmp_path, model_dir, dtype=torch.bfloat16)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.o_proj.weight"
    tensors[name] = tensors[name][:, :-16].contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"o_proj\.weight\[0:128\]: checkpoint tensor \(128, 240\)"):
        ModelRunner.from_config(WorkerConfig(model=str(path), num_kv_blocks=16, max_model_len=128, device="cpu"), path)
