"""Quantized checkpoints across 2 ranks (spawned processes, gloo on loopback: tests/tp/moe_ranks.py), each rank
holding its share at the stored width, exact against transformers fp32 on the format's reference dequantization:
greedy tokens equal, logprobs within 1e-4, for whole prompts, uneven prefill chunks and a preemption.

    llama GGUF      Q4_K_M-like k-quants (q/k Q4_K + v Q6_K fused, gate/up Q5_K, down Q6_K, output Q5_K, a Q6_K
                    block embedding) with a legacy Q4_0 o_proj (its 256 columns cut at 128: whole 32-blocks) and
                    F16 / BF16 layers; llama.cpp's q/k row order undone by the whole model's heads
    qwen2 AWQ       int4 group 64 (o_proj's 128 columns cut at 64: one group per rank), packed Q4_1 on each rank
    qwen2 GPTQ      int4 group 32 act-order: each rank's columns hold uneven parts of the groups (torch formula)
    qwen2 FP8       compressed-tensors W8A8 per channel: o/down all-reduce the token amax (logprobs within 5e-2)
    qwen3-MoE GGUF  k-quant experts cut by their intermediate rows (sharded) or whole per rank (expert parallel);
                    also a repeated prompt hitting the first one's cached blocks (prefix caching)

Each rank's weights: no fp32 matrix but the routers and layers mixing F16 with a block type (an all-BF16 layer
keeps its 16 bits), and about half the stored bytes each."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.tp.moe_ranks import PREFIX_HIT, SCHEDULES, run_ranks
from tests.worker.quant_models import Spec, build_quant_model
from tests.worker.test_families import oracle, prompts

pytestmark = pytest.mark.slow      # each case: 2 spawned ranks loading a small model, ~1-2 min on 2 shared cores


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("STEPLOOP_CACHE_DIR", str(tmp_path / "cache"))


def _qwen3_moe_types(name: str, w) -> T:
    """k-quant experts (gate Q4_K + up Q5_K: the Q5_K form; down Q6_K, 512 rows cut at 256: whole super-blocks),
    layer 1's gate/up in the legacy types; o_proj Q8_0 (256 columns cut at 128: whole 32-blocks)"""
    layer1 = name.startswith("blk.1.")
    return {"token_embd": T.Q8_0, "output": T.Q6_K, "attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q4_K,
            "attn_output": T.Q8_0, "ffn_gate_inp": T.F32, "ffn_gate_exps": T.Q4_0 if layer1 else T.Q4_K,
            "ffn_up_exps": T.Q8_0 if layer1 else T.Q5_K, "ffn_down_exps": T.Q6_K}[name.split(".")[-2]]


def _gguf_case(tmp_path, model_dir, family: str):
    from steploop.gpu_worker.gguf_convert import convert_gguf
    from tests.worker.gguf_files import random_model, write_gguf
    from tests.worker.test_gguf_direct import _llama_types
    from tests.worker.test_gguf_moe import reference_model
    if family == "llama":
        model = random_model("LlamaConfig", tie_word_embeddings=False)
        # layer 0's o_proj Q4_K: 256 columns cut at 128, inside a super-block: read as fp32 on each rank
        types = lambda name, w: T.Q4_K if name == "blk.0.attn_output.weight" else _llama_types(name, w)  # noqa: E731
    else:
        model = random_model("Qwen3MoeConfig", num_experts=4, moe_intermediate_size=512, head_dim=64,
                             norm_topk_prob=True, tie_word_embeddings=False, num_experts_per_tok=2)
        types = _qwen3_moe_types
    path = write_gguf(model, tmp_path / f"{family}.gguf", model_dir, qtype_of=types)
    folder = convert_gguf(path)
    if family == "llama":      # transformers' own GGUF reader (gguf-py's dequantize, llama.cpp's q/k order undone)
        import transformers

        from steploop.gpu_worker.gguf.reader import fast_gguf_readers
        with fast_gguf_readers():
            return folder, transformers.AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager").eval()
    return folder, reference_model(path, folder)


def _check(ranks, expected, schedules, where: str, tolerance: float = 1e-4) -> None:
    (served0, _), (served1, _) = ranks
    for (chunk, preempt), got0, got1 in zip(schedules, served0, served1):
        at = f"{where} chunk {chunk} preempt {preempt}"
        assert [t for t, _ in got0.values()] == [t for t, _ in got1.values()], f"{at}: the ranks differ"
        for handle, (tokens, logprobs) in got0.items():
            want_tokens, want_logprobs = expected[handle]
            assert tokens == want_tokens, f"{at} prompt {handle}: {tokens} != {want_tokens}"
            assert logprobs == pytest.approx(want_logprobs, abs=tolerance), f"{at} prompt {handle}"


def _check_widths(ranks, allowed_fp32: tuple[str, ...]) -> None:
    """Only the allowed fp32 matrices (routers, layers stored as floats); stored bytes split about evenly."""
    stored = []
    for _, report in ranks:
        fp32 = [n for n in report["fp32_matrices"] if not n.replace(".inner.", ".").endswith(allowed_fp32)]
        assert not fp32, f"fp32 copies of quantized weights on a rank: {fp32}"
        stored.append(report["stored_bytes"])
    assert min(stored) > 0.8 * max(stored), stored


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_gguf_tp2_at_width_equals_transformers(family, tmp_path, model_dir):
    folder, hf = _gguf_case(tmp_path, model_dir, family)
    expected = [oracle(hf, p) for p in prompts()]
    modes = [False, True] if family == "qwen3_moe" else [False]
    for expert_parallel in modes:
        schedules = SCHEDULES + ([PREFIX_HIT] if family == "qwen3_moe" else [])
        ranks = run_ranks(folder, 2, expert_parallel, schedules=schedules)
        hit = {0: expected[-1], 1: expected[-1]}     # the prefix-hit schedule serves the last prompt twice
        _check([(s[:len(SCHEDULES)], r) for s, r in ranks], expected, SCHEDULES, f"{family} ep {expert_parallel}")
        if family == "qwen3_moe":
            _check([(s[len(SCHEDULES):], r) for s, r in ranks], hit, [PREFIX_HIT], f"{family} prefix hit")
        # llama: layer 1's gate/up (Q5_K + F16 rows) may be fp32 (as on one rank; its BF16 down is 16-bit), and
        # layer 0's o_proj cut inside its super-blocks; MoE: the routers
        _check_widths(ranks, ("mlp.gate.weight",) if family == "qwen3_moe" else
                      ("layers.1.mlp.gate_up_proj.weight", "layers.1.mlp.down_proj.weight",
                       "layers.0.self_attn.o_proj.weight"))


@pytest.mark.parametrize("spec", [Spec("awq", 4, 64, False), Spec("gptq", 4, 32, False, desc_act=True),
                                  Spec("ct_fp8", fp8_channel=True)], ids=lambda s: s.id)
def test_qwen2_quantized_tp2_equals_transformers(spec, tmp_path, model_dir):
    path, hf = build_quant_model("qwen2", spec, tmp_path / spec.id, model_dir)
    expected = [oracle(hf, p) for p in prompts()]
    ranks = run_ranks(path, 2)
    # FP8 W8A8: 5e-2, as on one rank (tests/worker/test_quant_e2e.py: e4m3 activations amplify fp32 reordering)
    _check(ranks, expected, SCHEDULES, f"qwen2 {spec.id}", 5e-2 if spec.method == "ct_fp8" else 1e-4)
    _check_widths(ranks, ("embed_tokens.weight",))       # not quantized in the checkpoint (tied lm_head)
