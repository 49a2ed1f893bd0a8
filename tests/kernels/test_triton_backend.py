"""The triton attention backend and the triton-ops model against the torch oracle; the CUDA-graph padding path
run eagerly; and (slow) the real default model's greedy tokens through both backends."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from steploop.gpu_worker.attention.metadata import build_common_metadata
from steploop.gpu_worker.attention.selector import create_backend
from steploop.gpu_worker.capture_plan import CapturePlan
from steploop.gpu_worker.cuda_graphs import StepGraphRunner
from steploop.gpu_worker.model.llama import LlamaForCausalLM
from steploop.gpu_worker.model.model_config import LlamaModelConfig
from tests.kernels.attention_cases import make_case
from tests.kernels.conftest import assert_close

TINY = LlamaModelConfig(vocab_size=97, hidden_size=256, intermediate_size=320, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
                        rope_theta=10000.0, max_position_embeddings=128, tie_word_embeddings=True)


@pytest.mark.parametrize("num_splits", [None, 2])
def test_backend_matches_torch_backend(num_splits, device):
    case = make_case([5, 1, 19, 1], [0, 31, 13, 16], device=device)
    torch_be = create_backend("torch", 4, 2, 64, 0.125)
    triton_be = create_backend("triton", 4, 2, 64, 0.125)
    triton_be.num_splits = num_splits
    cache_t, cache_k = case.kv_cache.clone(), case.kv_cache.clone()
    want = torch_be.forward(0, case.q, case.k, case.v, cache_t, torch_be.build_metadata(case.common))
    got = triton_be.forward(0, case.q, case.k, case.v, cache_k, triton_be.build_metadata(case.common))
    assert torch.equal(cache_t, cache_k)
    assert_close(got, want, torch.float32)


def tiny_models(device, cfg: LlamaModelConfig = TINY) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    torch.manual_seed(0)
    models = []
    for name in ("torch", "triton"):
        m = LlamaForCausalLM(cfg, create_backend(name, 4, 2, 64, 0.125), 128).to(device)
        m.tie_weights()
        m.rotary.build_cache(device, torch.float32)
        models.append(m)
    models[1].load_state_dict(models[0].state_dict())
    with torch.no_grad():       # non-trivial norm weights so the fused norms are really checked
        for m in models:
            for name, p in m.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1 + 0.1 * torch.arange(p.numel(), device=device).sin())
    return models[0], models[1]


def batch(query_lens, cached, block_size, device):
    seq = [c + q for c, q in zip(cached, query_lens)]
    nblk = [-(-s // block_size) for s in seq]
    tables = np.zeros((len(seq), max(nblk)), np.int32)
    nxt = 1
    for r, n in enumerate(nblk):
        tables[r, :n] = np.arange(nxt, nxt + n)
        nxt += n
    pos = np.concatenate([np.arange(c, s) for c, s in zip(cached, seq)])
    req = np.repeat(np.arange(len(seq)), query_lens)
    slots = tables[req, pos // block_size].astype(np.int64) * block_size + pos % block_size
    common = build_common_metadata(np.array(query_lens, np.int32), np.array(seq, np.int32), tables, slots,
                                   block_size, device)
    ids = torch.randint(0, TINY.vocab_size, (len(pos),), generator=torch.Generator().manual_seed(1)).to(device)
    return ids, torch.from_numpy(pos).to(device), common


def kv_caches(device):
    return [torch.zeros((2, 16, 8, 2, 64), device=device) for _ in range(TINY.num_hidden_layers)]


def test_tiny_model_triton_ops_match_torch(device):
    """Fused norm/rotary/SiLU + triton attention vs the torch path, prompt chunks then a decode step."""
    m_torch, m_triton = tiny_models(device)
    caches = {m: kv_caches(device) for m in ("torch", "triton")}
    for query_lens, cached in (([9, 4], [0, 0]), ([1, 3], [9, 4])):
        ids, pos, common = batch(query_lens, cached, 8, device)
        rows = torch.tensor(np.cumsum(query_lens) - 1, device=device)
        outs = [m(ids, pos, caches[name], m.backend.build_metadata(common), rows)
                for name, m in (("torch", m_torch), ("triton", m_triton))]
        assert_close(outs[1], outs[0], torch.float32, scale=10)


def test_windowed_softcapped_layers_run_in_the_kernel(device):
    """Gemma 2's shape of attention (a local layer with a 5-token window, a global one, both soft-capped, its own
    scale): the triton model attends every layer in the kernel (no torch windowed path), and matches the torch model
    (whose windowed layers run model/windowed_attention.py) over prompt chunks and decodes past the window."""
    cfg = dataclasses.replace(TINY, layer_windows=(5, None), attn_softcap=2.0, attention_scale=0.3)
    m_torch, m_triton = tiny_models(device, cfg)
    assert all(layer.self_attn.windowed is not None for layer in m_torch.model.layers)
    assert all(layer.self_attn.windowed is None for layer in m_triton.model.layers)
    assert m_triton.backend.variants == {0: (5, 2.0), 1: (None, 2.0)}
    caches = {m: kv_caches(device) for m in ("torch", "triton")}
    for query_lens, cached in (([9, 4], [0, 0]), ([1, 3], [9, 4]), ([1, 1], [10, 7])):
        ids, pos, common = batch(query_lens, cached, 8, device)
        rows = torch.tensor(np.cumsum(query_lens) - 1, device=device)
        outs = [m(ids, pos, caches[name], m.backend.build_metadata(common), rows)
                for name, m in (("torch", m_torch), ("triton", m_triton))]
        assert_close(outs[1], outs[0], torch.float32, scale=10)


def _graph_vs_eager(device, query_lens, cached, num_logits_rows):
    """One step through the graph runner (capture=False: its static buffers, padding and fixed metadata, run
    eagerly) and through the plain forward, from the same prefilled cache."""
    _, model = tiny_models(device)
    prefill_ids, prefill_pos, prefill = batch([5, 9, 2], [0, 0, 0], 8, device)
    plain, graphed = kv_caches(device), kv_caches(device)
    for caches in (plain, graphed):
        model(prefill_ids, prefill_pos, caches, model.backend.build_metadata(prefill), torch.tensor([0], device=device))
    ids, pos, common = batch(query_lens, cached, 8, device)
    rows = torch.tensor(num_logits_rows, device=device)
    md = model.backend.build_metadata(common)
    want = model(ids, pos, plain, md, rows)
    plan = CapturePlan(qpk_p=2, max_reqs=4, max_tokens=32, lora=False, decode_sizes=(1, 2, 4), mixed_sizes=(16, 32))
    runner = StepGraphRunner(model, graphed, block_size=8, max_model_len=128, plan=plan, capture=False)
    runner.buffers.input_ids.fill_(7)
    runner.buffers.seq_lens.fill_(99)
    got = runner.run(ids, pos, common, md.plan, rows)
    return runner, want, got, plain, graphed


def test_decode_graph_padding_eager(device):
    """3 decodes padded to the 4-request graph (pad slots -1, pad requests empty): the same hidden states as a plain
    forward, and the pads write nothing into the cache."""
    runner, want, got, plain, graphed = _graph_vs_eager(device, [1, 1, 1], [5, 9, 2], [0, 1, 2])
    assert list(runner.replays) == [runner.plan.choose(np.ones(3, np.int32), 3).shape.key]
    assert runner.replays.popitem()[0].tokens == 4
    assert got.shape == want.shape
    assert_close(got, want, torch.float32)
    for a, b in zip(plain, graphed):
        assert_close(b, a, torch.float32)              # (a batch of 4 may round the projections differently)
        assert not b[:, 0].any() and not b[:, 5:].any()   # null block and unused blocks untouched by the pads


def test_mixed_graph_padding_eager(device):
    """A mixed step (a prompt chunk, a decode, a 2-token draft verification: 3 logits rows for one request) padded
    to the 16-token mixed graph: the same hidden states and cache as the plain forward."""
    runner, want, got, plain, graphed = _graph_vs_eager(device, [6, 1, 3], [5, 9, 2], [5, 6, 7, 8, 9])
    (key, n), = runner.replays.items()
    assert (key.kind, key.tokens, n) == ("mixed", 16, 1)
    assert_close(got, want, torch.float32)
    for a, b in zip(plain, graphed):
        assert_close(b, a, torch.float32)
        assert not b[:, 0].any() and not b[:, 8:].any()


def test_steps_past_every_graph_run_eagerly(device):
    runner, _, got, *_ = _graph_vs_eager(device, [20, 1, 12], [5, 9, 2], [19, 20, 32])
    assert got is None and not runner.replays       # 33 tokens > the 32-token graph


@pytest.mark.slow
def test_real_model_greedy_tokens_match(model_dir, monkeypatch):
    """The converted default model (30 layers) through ModelRunner: torch backend vs triton backend under the
    interpreter, 4 prompt tokens then 3 greedy tokens (prefill in two chunks, 4-token blocks: crossings). Slow (~1 min)."""
    from steploop.gpu_worker.config import WorkerConfig
    from steploop.gpu_worker.model_runner import ModelRunner
    from tests.worker.driver import Driver

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompt = [1, 504, 3458, 282]
    tokens = {}
    for backend in ("torch", "triton"):
        cfg = WorkerConfig(model=str(model_dir), num_kv_blocks=16, block_size=4, max_model_len=32, device=device,
                           dtype="float32", attention_backend=backend, cuda_graphs=False)
        driver = Driver(ModelRunner.from_config(cfg, model_dir))
        driver.add(0, prompt, 3)
        tokens[backend] = driver.run(chunk=3)[0]
    assert tokens["triton"] == tokens["torch"]
