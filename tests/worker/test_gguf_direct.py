"""`--model FILE.gguf` read at its own bit width (gpu_worker/gguf/): small random Llama, Qwen2, Gemma 2 / 3 and Phi-3 models written as
GGUF with a different block type per tensor (every type steploop reads; the k-quants as random valid blocks), served
by the ModelRunner from the file's blocks: greedy tokens equal and logprobs within 1e-4 of transformers fp32 on the
same file (its GGUF loader dequantizes with gguf-py), also under chunked prefill and preemption. The converted folder
holds no weights, and no block-quantized linear or embedding keeps an fp32 copy. Broken files (an unknown tensor type, a cut
file, a tensor whose size does not fit its shape and type) are refused naming the tensor: the worker exits 2
before serving."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
import torch
from gguf import GGMLQuantizationType as T

from steploop.common.model_path import gguf_model_dir
from steploop.gpu_worker.cpu_kernels.packed_weights import KIND_NAMES, Q4_K, Q6_K, SPLIT
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.gguf.block_embedding import BlockEmbedding
from steploop.gpu_worker.gguf.reader import GGUFFileError, fast_gguf_readers, open_gguf
from steploop.gpu_worker.gguf_convert import convert_gguf
from steploop.gpu_worker.model.half_weights import HalfEmbedding
from steploop.gpu_worker.model.packed_linear_layer import PackedLinear
from steploop.gpu_worker.model_runner import ModelRunner
from tests.worker import gguf_bad_files as bad
from tests.worker.family_models import _COMMON
from tests.worker.gguf_files import random_model, write_gguf
from tests.worker.test_cpu_decoder import both_paths
from tests.worker.test_families import oracle, prompts, serve


def _llama_types(name: str, w) -> T:
    """Q4_K_M-like (q, k Q4_K with v Q6_K in one fused layer) plus every other k-quant and the float types"""
    layer1 = name.startswith("blk.1.")
    return {"token_embd": T.Q6_K, "output": T.Q5_K, "attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K,
            "attn_output": T.Q4_0, "ffn_gate": T.Q5_K, "ffn_up": T.F16 if layer1 else T.Q5_K,
            "ffn_down": T.BF16 if layer1 else T.Q6_K}[name.split(".")[-2]]


def _q4_k_m_types(name: str, w) -> T:
    """Q4_K_M's mix: q, k Q4_K with v Q6_K (a SPLIT weight: each run of rows in its own form), Q6_K ffn_down"""
    return {"token_embd": T.Q6_K, "output": T.Q6_K, "attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K,
            "attn_output": T.Q4_K, "ffn_gate": T.Q4_K, "ffn_up": T.Q4_K, "ffn_down": T.Q6_K}[name.split(".")[-2]]


def _qwen2_types(name: str, w) -> T:
    return {"token_embd": T.Q8_0, "attn_q": T.Q5_0, "attn_k": T.Q5_1, "attn_v": T.Q4_1, "attn_output": T.Q8_0,
            "ffn_gate": T.Q4_1, "ffn_up": T.Q4_0, "ffn_down": T.Q5_1}[name.split(".")[-2]]


def _gemma2_types(name: str, w) -> T:
    """k-quants everywhere: a tied Q6_K embedding, Q4_K + Q5_K fused in q/k/v, Q6_K + Q6_K in gate/up"""
    return {"token_embd": T.Q6_K, "attn_q": T.Q4_K, "attn_k": T.Q5_K, "attn_v": T.Q4_K, "attn_output": T.Q5_K,
            "ffn_gate": T.Q6_K, "ffn_up": T.Q6_K, "ffn_down": T.Q4_K}[name.split(".")[-2]]


def _phi3_types(name: str, w) -> T:
    """Phi-3's q/k/v and gate/up come fused in the file (one tensor each)"""
    return {"token_embd": T.Q8_0, "output": T.Q4_K, "attn_qkv": T.Q6_K, "attn_output": T.Q5_K, "ffn_up": T.Q4_K,
            "ffn_down": T.Q6_K}[name.split(".")[-2]]


def _f16_types(name: str, w) -> T:
    """An "F16" file (llama.cpp's --outtype f16): every matrix F16, a tied table; BF16 for the MLP's down rows"""
    return T.BF16 if ".ffn_down." in name else T.F16


MODELS = {"llama": ("LlamaConfig", {"tie_word_embeddings": False}, _llama_types),
          "qwen2_f16": ("Qwen2Config", {"tie_word_embeddings": True}, _f16_types),
          "phi3": ("Phi3Config", {"tie_word_embeddings": False}, _phi3_types),
          "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}, _qwen2_types),
          "gemma2": ("Gemma2Config", {"head_dim": 64, "sliding_window": 16, "query_pre_attn_scalar": 48,
                                      "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}, _gemma2_types),
          "gemma3_text": ("Gemma3TextConfig", {"head_dim": 64, "sliding_window": 16}, _gemma2_types)}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("STEPLOOP_CACHE_DIR", str(tmp_path / "cache"))


def gguf_file(family: str, folder, model_dir):
    name, kwargs, types = MODELS[family]
    model = random_model(name, **kwargs)
    with torch.no_grad():            # Gemma's norms off their init (zeros, stored as 1 + w) so each one counts
        for param_name, p in model.named_parameters():
            if "norm" in param_name and family.startswith("gemma"):
                p.add_(torch.randn_like(p) * 0.1)
    return write_gguf(model, folder / f"{family}-mixed.gguf", model_dir, qtype_of=types)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(MODELS))
def test_gguf_blocks_serve_transformers_greedy_tokens(family, tmp_path, model_dir, caplog):
    import transformers
    path = gguf_file(family, tmp_path, model_dir)
    folder = convert_gguf(path)
    assert not list(folder.glob("*.safetensors")) and (folder / "gguf_source.json").is_file()
    with fast_gguf_readers():
        hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    with caplog.at_level("INFO"):
        runner = ModelRunner.from_config(WorkerConfig(model=str(path), num_kv_blocks=64, max_model_len=256,
                                                      device="cpu"), folder)
    assert "GGUF weights in memory" in caplog.text
    linears = [m for m in runner.model.modules() if isinstance(m, PackedLinear)]
    if runner.model.plan.packed_linears:          # block types packed from the file, F16 / BF16 kept 16-bit
        packed = [m for m in linears if m.packed is not None]
        # llama's layer 1 gate/up mixes Q5_K with F16 rows: fp32; its BF16 down: 16-bit
        assert len(packed) == len(linears) - (1 if family == "llama" else 0)
        assert all(m.weight is None for m in packed)
        if family == "llama":
            assert KIND_NAMES[runner.model.model.layers[1].mlp.down_proj.packed.kind] == "bf16"
        if family == "qwen2_f16":     # the F16 table stays 16-bit, its tied head multiplying by the same tensor
            assert {KIND_NAMES[m.packed.kind] for m in packed} == {"bf16", "fp16"}
            assert isinstance(runner.model.model.embed_tokens, HalfEmbedding)
            assert runner.model.model.embed_tokens.packed is runner.model.lm_head.packed
        else:
            assert isinstance(runner.model.model.embed_tokens, BlockEmbedding)      # no fp32 table either
    expected = [oracle(hf, p) for p in prompts()]
    for chunk, preempt_after in [(512, None), (16, 8)]:
        got = serve(runner, chunk, preempt_after)
        for handle, (want_tokens, want_logprobs) in enumerate(expected):
            tokens, logprobs = got[handle]
            assert tokens == want_tokens, f"{family} chunk {chunk} prompt {handle}"
            assert logprobs == pytest.approx(want_logprobs, abs=1e-4), f"{family} chunk {chunk} prompt {handle}"


def test_split_qkv_runs_in_the_c_decoder_bit_for_bit(tmp_path, model_dir):
    """Q4_K_M's q/k/v in two forms: decoder.c places each part's columns as the layer-by-layer path does"""
    path = write_gguf(random_model("LlamaConfig", tie_word_embeddings=False), tmp_path / "q4_k_m.gguf", model_dir,
                      qtype_of=_q4_k_m_types)
    runner = ModelRunner.from_config(WorkerConfig(model=str(path), num_kv_blocks=32, max_model_len=128, device="cpu"),
                                     convert_gguf(path))
    qkv = runner.model.model.layers[0].self_attn.qkv_proj.packed
    assert qkv.kind == SPLIT and [p.kind for p in qkv.parts] == [Q4_K, Q6_K]
    assert runner.model.cpu_decoder is not None
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randint(3, 200, (20,), generator=gen).tolist(), torch.randint(3, 200, (9,), generator=gen).tolist()
    used, fast, slow, fast_kv, slow_kv = both_paths(runner, [(a, [0, 1], 0, 20), (b, [2], 0, 9)])   # chunks
    assert used and torch.equal(fast, slow) and all(torch.equal(x, y) for x, y in zip(fast_kv, slow_kv))
    used, fast, slow, _, _ = both_paths(runner, [(a, [0, 1], 19, 1)])                                  # a decode
    assert used and torch.equal(fast, slow)


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory, model_dir):
    """A one-layer Llama, Q8_0 linears, every tensor in file order (the first is token_embd)."""
    import transformers
    cfg = transformers.LlamaConfig(**{**_COMMON, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                                      "num_attention_heads": 2, "num_key_value_heads": 1,
                                      "tie_word_embeddings": True})
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    return write_gguf(transformers.LlamaForCausalLM(cfg), path, model_dir, qtype_of=lambda name, w: T.Q8_0)


def _broken(small_gguf, tmp_path, how: str):
    path = tmp_path / f"broken-{how}.gguf"
    shutil.copy(small_gguf, path)
    if how == "unknown type":
        bad.with_type(path, "blk.0.attn_q.weight", 99)
    elif how == "unread type":
        bad.with_type(path, "blk.0.attn_q.weight", int(T.IQ2_XXS))
    elif how == "truncated":
        bad.truncated(path, 100)
    elif how == "size":
        bad.with_extra_rows(path, bad.first_2d_tensor(path), 1)
    else:
        bad.truncated(path, path.stat().st_size - 200)
    return path


BROKEN = {"unknown type": r"tensor 'blk.0.attn_q.weight' has GGUF tensor type 99, which is unknown",
          "unread type": r"tensor 'blk.0.attn_q.weight' has GGUF tensor type IQ2_XXS, which steploop does not read",
          "truncated": r"tensor 'output_norm.weight' .* runs past the end of the file .*truncated",
          "size": r"tensor '[^']+' \(Q8_0 \[\d+, 64\].* overlaps tensor .* its size does not match",
          "header": r"not a readable GGUF file"}


@pytest.mark.parametrize("how", sorted(BROKEN))
def test_broken_files_are_refused_naming_the_tensor_before_any_folder(how, small_gguf, tmp_path):
    path = _broken(small_gguf, tmp_path, how)
    with pytest.raises(GGUFFileError, match=BROKEN[how]):
        open_gguf(path)
    with pytest.raises(ValueError, match=BROKEN[how]):
        convert_gguf(path)
    assert not gguf_model_dir(str(path)).exists()


@pytest.mark.slow
def test_worker_exits_2_on_broken_files_before_serving(small_gguf, tmp_path):
    """One worker process per broken file, pointed at a scheduler address nobody listens on: it must exit 2 with
    the tensor named, never reach the attach loop."""
    for how in ("unknown type", "truncated", "size"):
        path = _broken(small_gguf, tmp_path, how)
        proc = subprocess.run([sys.executable, "-m", "steploop.gpu_worker", "--model", str(path), "--device", "cpu",
                               "--scheduler-address", "127.0.0.1:9"], check=False, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 2, (how, proc.stderr[-2000:])
        assert re.search(BROKEN[how], proc.stderr), (how, proc.stderr[-2000:])
        assert "attached to scheduler" not in proc.stderr and "loading model" not in proc.stderr


def test_a_folder_holding_one_gguf_file_names_that_file(small_gguf, tmp_path):
    from steploop.common.model_path import gguf_file, is_gguf, served_model_name
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(small_gguf, folder / "small.gguf")
    assert is_gguf(str(folder)) and gguf_file(str(folder)) == (folder / "small.gguf").resolve()
    assert gguf_model_dir(str(folder)) == gguf_model_dir(str(folder / "small.gguf"))
    assert served_model_name(str(folder), folder) == "small"
    shutil.copy(small_gguf, folder / "other.gguf")            # two files: not one model
    assert not is_gguf(str(folder))
