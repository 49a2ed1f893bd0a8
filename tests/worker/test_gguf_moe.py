"""Mixture-of-experts GGUF files (Qwen3-MoE, Qwen2-MoE, and Mixtral as llama.cpp converts it: a llama-arch file
with experts; llama.cpp's stacked ffn_{gate,up,down}_exps tensors, one [experts, rows, k] tensor per projection)
read at their stored width: each expert packed on its own from the file's
blocks (an expert's gate and up rows fused, as a dense gate/up is), no fp32 copy of any block-quantized expert.
Greedy tokens equal and logprobs within 1e-4 of transformers fp32 on gguf-py's dequantization of the same file,
also under chunked prefill and preemption. The config comes from the file's metadata, including what transformers'
GGUF reader misses (the experts' width; every qwen2moe key; that a llama file with experts is a Mixtral)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.cpu_kernels.packed_weights import PackedWeight
from steploop.gpu_worker.gguf_convert import convert_gguf
from steploop.gpu_worker.model.moe import SparseMoE
from steploop.gpu_worker.model_runner import ModelRunner
from tests.worker.gguf_files import gguf_names, random_model, write_gguf
from tests.worker.test_families import oracle, prompts, serve

_QWEN_MOE = {"num_experts": 4, "moe_intermediate_size": 256}


def _qwen3_moe_types(name: str, w) -> T:
    """k-quant experts (gate Q4_K fused with up Q5_K: the Q5_K form; down Q6_K), layer 1's gate/up in the
    32-blocks' common int8 form (Q4_0 with Q8_0)"""
    layer1 = name.startswith("blk.1.")
    return {"token_embd": T.Q8_0, "output": T.Q6_K, "attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K,
            "attn_output": T.Q5_K, "ffn_gate_inp": T.F32, "ffn_gate_exps": T.Q4_0 if layer1 else T.Q4_K,
            "ffn_up_exps": T.Q8_0 if layer1 else T.Q5_K, "ffn_down_exps": T.Q6_K}[name.split(".")[-2]]


def _qwen2_moe_types(name: str, w) -> T:
    """Q4_K_M-like experts and shared expert (the routers F32: they stay fp32 linears); layer 1's down experts F16
    (an fp32 parameter, not packed). q/k/v all Q4_K: with v Q6_K the fused q/k/v takes the int8 Q8_1/16 form,
    whose other summation order moves this small model's logprobs by 1.4e-4 (the experts fp32 or packed alike)."""
    layer1 = name.startswith("blk.1.")
    return {"token_embd": T.Q6_K, "attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q4_K, "attn_output": T.Q4_K,
            "ffn_gate_inp": T.F32, "ffn_gate_exps": T.Q4_K, "ffn_up_exps": T.Q4_K,
            "ffn_down_exps": T.F16 if layer1 else T.Q6_K, "ffn_gate_shexp": T.Q4_K, "ffn_up_shexp": T.Q4_K,
            "ffn_down_shexp": T.Q6_K}[name.split(".")[-2]]


def _mixtral_types(name: str, w) -> T:
    """Q4_K_M-like: experts gate/up Q4_K, down Q6_K; layer 1's down Q5_K"""
    layer1 = name.startswith("blk.1.")
    return {"token_embd": T.Q4_K, "output": T.Q6_K, "attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q4_K,
            "attn_output": T.Q4_K, "ffn_gate_inp": T.F32, "ffn_gate_exps": T.Q4_K, "ffn_up_exps": T.Q4_K,
            "ffn_down_exps": T.Q5_K if layer1 else T.Q6_K}[name.split(".")[-2]]


MODELS = {"qwen3_moe": ("Qwen3MoeConfig", {**_QWEN_MOE, "head_dim": 64, "norm_topk_prob": True,
                                           "tie_word_embeddings": False}, _qwen3_moe_types),
          "mixtral": ("MixtralConfig", {"num_local_experts": 4, "intermediate_size": 256, "sliding_window": None,
                                        "tie_word_embeddings": False}, _mixtral_types),
          "qwen2_moe": ("Qwen2MoeConfig", {**_QWEN_MOE, "shared_expert_intermediate_size": 256,
                                           "norm_topk_prob": False, "tie_word_embeddings": True}, _qwen2_moe_types)}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("STEPLOOP_CACHE_DIR", str(tmp_path / "cache"))


def moe_file(family: str, folder, model_dir):
    name, kwargs, types = MODELS[family]
    model = random_model(name, num_experts_per_tok=2, **kwargs)
    return write_gguf(model, folder / f"{family}-mixed.gguf", model_dir, qtype_of=types)


def reference_model(path, folder):
    """transformers fp32 with the converted config and gguf-py's dequantization of every tensor in the file (the
    stacked experts split per expert, as transformers' Qwen2MoeTensorProcessor splits them)."""
    import gguf
    import transformers
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    config = transformers.AutoConfig.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                          attn_implementation="eager")
    names = gguf_names(model)
    unpermute = LlamaTensorProcessor(config={"num_attention_heads": config.num_attention_heads,
                                             "num_key_value_heads": config.num_key_value_heads})
    state = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        w = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        w = w.reshape([int(x) for x in reversed(tensor.shape.tolist())])
        if config.model_type == "mixtral":        # a llama-arch file: llama.cpp's q/k row order undone
            w = unpermute.process(w, tensor.name).weights
        hf = names[tensor.name]
        if w.ndim == 3:
            state.update({hf.replace(".experts.", f".experts.{e}."): torch.from_numpy(w[e].copy())
                          for e in range(w.shape[0])})
        else:
            state[hf] = torch.from_numpy(w).reshape(model.state_dict()[hf].shape)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(MODELS))
def test_moe_gguf_experts_serve_at_their_width_as_transformers(family, tmp_path, model_dir, caplog):
    path = moe_file(family, tmp_path, model_dir)
    folder = convert_gguf(path)
    assert not list(folder.glob("*.safetensors"))
    hf = reference_model(path, folder)
    cfg = hf.config               # the file's own sizes, not the config class's defaults transformers' reader keeps
    if family == "mixtral":       # transformers' reader alone takes the file for a dense Llama
        assert (cfg.model_type, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size) == \
            ("mixtral", 4, 2, 256)
    else:
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 256)
        assert cfg.norm_topk_prob == (family == "qwen3_moe")
    with caplog.at_level("INFO"):
        runner = ModelRunner.from_config(WorkerConfig(model=str(path), num_kv_blocks=64, max_model_len=256,
                                                      device="cpu"), folder)
    moes = [m for m in runner.model.modules() if isinstance(m, SparseMoE)]
    assert len(moes) == 2
    if runner.model.plan.packed_linears:          # block-quantized experts packed per expert, no fp32 parameter
        line = next(r.getMessage() for r in caplog.records if "GGUF weights in memory" in r.getMessage())
        for qtype in ("Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q8_0"):
            assert not re.search(rf"\b{qtype} [\d.]+ MiB -> [^;]*fp32", line), line
        for i, moe in enumerate(moes):
            fp32_down = family == "qwen2_moe" and i == 1
            assert moe.w13 is None and len(moe.packed_experts["w13"]) == 4
            assert all(isinstance(w, PackedWeight) for w in moe.packed_experts["w13"])
            assert (moe.w2 is not None and "w2" not in moe.packed_experts) if fp32_down else moe.w2 is None
            if family == "qwen2_moe":
                assert moe.shared_w13 is None and moe.shared_w2 is None
    expected = [oracle(hf, p) for p in prompts()]
    for chunk, preempt_after in [(512, None), (16, 8)]:
        got = serve(runner, chunk, preempt_after)
        for handle, (want_tokens, want_logprobs) in enumerate(expected):
            tokens, logprobs = got[handle]
            assert tokens == want_tokens, f"{family} chunk {chunk} prompt {handle}"
            assert logprobs == pytest.approx(want_logprobs, abs=1e-4), f"{family} chunk {chunk} prompt {handle}"


def test_stacked_experts_split_into_each_experts_hf_name():
    from steploop.gpu_worker.gguf.weights import _split_experts

    class Stacked:                  # a ReaderTensor's shape: GGUF order, k first, experts last
        shape = np.array([256, 128, 3])
    assert _split_experts(Stacked, "model.layers.1.mlp.experts.gate_proj.weight") == [
        (e, f"model.layers.1.mlp.experts.{e}.gate_proj.weight") for e in range(3)]
    assert _split_experts(Stacked, "model.layers.0.block_sparse_moe.experts.w2.weight")[2] == \
        (2, "model.layers.0.block_sparse_moe.experts.2.w2.weight")
    assert _split_experts(Stacked, "model.layers.0.mlp.shared_expert.up_proj.weight") == \
        [(None, "model.layers.0.mlp.shared_expert.up_proj.weight")]


def _metadata_only(path, arch: str, **keys):
    import gguf
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(str(path))


def test_moe_config_takes_the_experts_from_the_metadata(tmp_path):
    import transformers

    from steploop.gpu_worker.gguf.moe_config import mixtral_config, moe_config
    reader = _metadata_only(tmp_path / "q2.gguf", "qwen2moe", expert_count=6, expert_used_count=2,
                            expert_feed_forward_length=64, expert_shared_feed_forward_length=96, embedding_length=128)
    assert moe_config(reader, "qwen2moe") == {
        "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 96,
        "hidden_size": 128, "norm_topk_prob": False, "mlp_only_layers": [], "decoder_sparse_step": 1}
    assert moe_config(reader, "qwen2") == {}
    reader = _metadata_only(tmp_path / "q3.gguf", "qwen3moe", expert_count=8, expert_weights_norm=0)
    assert moe_config(reader, "qwen3moe")["norm_topk_prob"] is False          # the file's own word wins
    reader = _metadata_only(tmp_path / "mixtral.gguf", "llama", expert_count=8, expert_used_count=2)
    llama = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    mixtral = mixtral_config(reader, "llama", llama)
    assert (mixtral.model_type, mixtral.num_local_experts, mixtral.num_experts_per_tok, mixtral.intermediate_size,
            mixtral.hidden_size, mixtral.num_key_value_heads, mixtral.sliding_window) == \
        ("mixtral", 8, 2, 256, 128, 2, None)
    assert mixtral_config(_metadata_only(tmp_path / "dense.gguf", "llama"), "llama", llama) is None
