"""A GGUF file served through the worker with the Triton kernels (under the interpreter; compiled on a GPU): every
block-quantized dense linear is a GgufLinear holding the file's values at about its width (no weight parameter), the
F16 / BF16 ones stay dense, and greedy tokens and logprobs (within 1e-4) equal transformers fp32 on the same file,
chunked and preempted. Llama with Q4_K_M's split q/k/v, every k-quant and Q4_0 (Qwen2's biases and the other legacy
types: tests/kernels/test_gguf_gemm.py and the loader test beside this one)."""

from __future__ import annotations

import pytest
import torch

from steploop.common import envs
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.gguf.block_embedding import BlockEmbedding
from steploop.gpu_worker.gguf.reader import fast_gguf_readers
from steploop.gpu_worker.gguf.triton_linear import GgufLinear
from steploop.gpu_worker.gguf_convert import convert_gguf
from steploop.gpu_worker.model_runner import ModelRunner
from tests.kernels.conftest import DEVICE
from tests.kernels.short_serve import PROMPTS, generate, serve
from tests.worker.test_gguf_direct import gguf_file



def _runner(family: str, tmp_path, model_dir, monkeypatch):
    """(the file, transformers on it, the worker's runner with the Triton kernels and no packed C forms)."""
    import transformers
    monkeypatch.setenv("STEPLOOP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(envs.CPU_KERNELS, "0")          # no packed C forms: the GPU's path, interpreted
    path = gguf_file(family, tmp_path, model_dir)
    folder = convert_gguf(path)
    with fast_gguf_readers():
        hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    runner = ModelRunner.from_config(WorkerConfig(model=str(path), num_kv_blocks=32, max_model_len=128,
                                                  device=DEVICE.type, dtype="float32", attention_backend="triton",
                                                  cuda_graphs=False), folder)
    return hf, runner


def _linears(runner) -> list:
    return [m for layer in runner.model.model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                               layer.mlp.gate_up_proj, layer.mlp.down_proj)]


@pytest.mark.slow     # converting and loading: about 17 s
def test_qwen2_biases_and_tied_embedding_stay_in_their_blocks(tmp_path, model_dir, monkeypatch):
    """q/k/v biases (F32 tensors beside Q5_0 / Q5_1 / Q4_1 blocks) are the GgufLinear's own, as the file holds them;
    one layer's output equals transformers' on the same input; the tied Q8_0 embedding stays in its blocks and the
    lm_head is a GgufLinear of the same blocks, both equal to transformers' table."""
    hf, runner = _runner("qwen2", tmp_path, model_dir, monkeypatch)
    held = _linears(runner)
    assert all(isinstance(m, GgufLinear) and m.weight is None for m in held)
    table = runner.model.model.embed_tokens
    assert isinstance(table, BlockEmbedding) and isinstance(runner.model.lm_head, GgufLinear)
    ids = torch.tensor([3, 100, 49151])
    assert torch.equal(table(ids.to(DEVICE)).cpu(), hf.model.embed_tokens(ids).detach())
    assert torch.equal(runner.model.lm_head.runs[0].dequantized().cpu(), hf.model.embed_tokens.weight.detach())
    ours, theirs = runner.model.model.layers[0].self_attn.qkv_proj, hf.model.layers[0].self_attn
    assert torch.equal(ours.bias.detach().cpu(), torch.cat([theirs.q_proj.bias, theirs.k_proj.bias,
                                                            theirs.v_proj.bias]).detach())
    x = torch.randn(3, ours.in_features, generator=torch.Generator().manual_seed(0))
    want = torch.cat([theirs.q_proj(x), theirs.k_proj(x), theirs.v_proj(x)], -1).detach()
    torch.testing.assert_close(ours(x.to(DEVICE)).cpu().detach(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.slow     # the interpreter: about a minute on 2 shared cores (a 49k-row lm_head in its blocks)
def test_gguf_blocks_in_the_triton_gemm_serve_transformers_tokens(tmp_path, model_dir, monkeypatch):
    family, dense = "llama", 2
    hf, runner = _runner(family, tmp_path, model_dir, monkeypatch)
    layers = runner.model.model.layers
    linears = _linears(runner)
    held = [m for m in linears if isinstance(m, GgufLinear)]
    assert len(held) == len(linears) - dense and all(m.weight is None for m in held)
    assert [r.describe() for r in layers[0].self_attn.qkv_proj.runs] == ["int4/32+m", "int8/16"]   # Q4_K | Q6_K
    assert isinstance(runner.model.lm_head, GgufLinear)                                             # Q5_K
    assert isinstance(runner.model.model.embed_tokens, BlockEmbedding)                              # Q6_K
    expected = [generate(hf, p) for p in PROMPTS]
    for chunk, preempt_after in [(512, None), (7, 4)]:
        got = serve(runner, chunk, preempt_after)
        for handle, (want_tokens, want_logprobs) in enumerate(expected):
            tokens, logprobs = got[handle]
            assert tokens == want_tokens, f"{family} chunk {chunk} prompt {handle}"
            assert logprobs == pytest.approx(want_logprobs, abs=1e-4), f"{family} chunk {chunk} prompt {handle}"
