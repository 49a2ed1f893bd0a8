"""The fused C paged attention kernel (cpu_kernels/) against a per-request torch reference, its build cache, and
the torch backend's use of it: the kernel for query_len <= 8 on the CPU, the same model output as gather + SDPA."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from steploop.common import envs
from steploop.gpu_worker.attention.metadata import build_common_metadata
from steploop.gpu_worker.attention.selector import create_backend
from steploop.gpu_worker.attention.torch_backend import (
    KERNEL_MAX_CHUNK_WORK,
    KERNEL_MAX_QUERY_LEN,
    _Group,
    _KernelGroup,
    kernel_eligible,
)
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.cpu_kernels import build
from steploop.gpu_worker.cpu_kernels import paged_attention as cpu_pa
from steploop.gpu_worker.kernel_plan import resolve_kernel_plan
from steploop.gpu_worker.model.llama import LlamaForCausalLM
from steploop.gpu_worker.model.model_config import LlamaModelConfig
from tests.kernels.attention_cases import make_case
from tests.worker.c_kernels import needs_c_kernels

pytestmark = needs_c_kernels(build.runnable_isas())

# seq_lens 1, 16 (= block_size), 17 (= block_size + 1), chunks of 3 and 8 (one crossing a block), long contexts
QUERY_LENS = [1, 1, 1, 3, 8, 1, 2, 8, 1, 5]
CACHED = [0, 15, 16, 13, 0, 40, 7, 9, 200, 27]


def reference(q, kv_cache, query_lens, seq_lens, block_tables, scale):
    """Per request: gather its keys through the block table, causal mask, softmax, in fp64."""
    _, _, block_size, hk, _ = kv_cache.shape
    out, start = torch.empty_like(q), 0
    for r, (n, length) in enumerate(zip(query_lens, seq_lens)):
        pos = torch.arange(length)
        blocks = block_tables[r].long()[pos // block_size]
        k, v = (kv_cache[i, blocks, pos % block_size].double() for i in (0, 1))       # [L, Hk, D]
        qr = q[start:start + n].double().unflatten(1, (hk, -1))                     # [n, Hk, G, D]
        scores = torch.einsum("nkgd,lkd->nkgl", qr, k) * scale
        visible = pos[None, :] <= (length - n + torch.arange(n))[:, None]          # [n, L]
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        out[start:start + n] = torch.einsum("nkgl,lkd->nkgd", scores.softmax(-1), v).flatten(1, 2).float()
        start += n
    return out


def run_kernel(case, threads=2, isa=None):
    out = torch.full_like(case.q, float("nan"))
    c = case.common
    cpu_pa.paged_attention(out, case.q, case.kv_cache, c.block_tables, c.query_start_loc, c.seq_lens,
                           case.q.shape[-1] ** -0.5, threads, isa=isa)
    return out


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2)], ids=["mha", "gqa3", "gqa4"])
def test_kernel_matches_reference(heads, head_dim):
    case = make_case(QUERY_LENS, CACHED, heads=heads, head_dim=head_dim, seed=head_dim + heads[0])
    assert len(set(case.block_tables.flatten().tolist()) - {0}) > 1     # shuffled, non-contiguous blocks
    want = reference(case.q, case.kv_cache, QUERY_LENS, case.seq_lens, case.block_tables, head_dim ** -0.5)
    torch.testing.assert_close(run_kernel(case), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("isa", build.runnable_isas())       # vector widths 16, 8 and 4 where this CPU runs them
@pytest.mark.parametrize("head_dim, block_size", [(64, 8), (64, 32), (72, 16), (80, 16), (32, 16)])
def test_every_build_matches_reference(head_dim, block_size, isa):
    """Keys scored a vector's width at a time (head_dim a multiple of it; 72 is not one of 16: the key-by-key path
    there), groups cut short by a block smaller than the vector, several groups in one block."""
    case = make_case(QUERY_LENS, CACHED, heads=(9, 3), head_dim=head_dim, block_size=block_size, seed=head_dim)
    want = reference(case.q, case.kv_cache, QUERY_LENS, case.seq_lens, case.block_tables, head_dim ** -0.5)
    torch.testing.assert_close(run_kernel(case, isa=isa), want, atol=1e-5, rtol=0)


def test_token_result_independent_of_batch():
    """Same request alone, in a batch, and with another thread count: bitwise the same output. The batch's 31
    tokens make one work item per token, the request alone one per (token, KV head): the same bits either way."""
    case = make_case(QUERY_LENS, CACHED, heads=(9, 3), seed=3)
    full = run_kernel(case)
    assert torch.equal(full, run_kernel(case, threads=1))
    r, start = 8, sum(QUERY_LENS[:8])                                    # the 201-token decode
    c = case.common
    out = torch.empty(1, 9, 64)
    cpu_pa.paged_attention(out, case.q[start:start + 1].contiguous(), case.kv_cache,
                           c.block_tables[r:r + 1].contiguous(), torch.tensor([0, 1], dtype=torch.int32),
                           c.seq_lens[r:r + 1].contiguous(), 64 ** -0.5, 2)
    assert torch.equal(out, full[start:start + 1])


def test_bad_arguments_raise():
    case = make_case([1, 2], [5, 30], heads=(4, 2))
    c, out = case.common, torch.empty_like(case.q)
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_pa.paged_attention(out, case.q.bfloat16(), case.kv_cache, c.block_tables, c.query_start_loc,
                               c.seq_lens, 0.125, 1)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_pa.paged_attention(out, case.q.transpose(0, 1), case.kv_cache, c.block_tables, c.query_start_loc,
                               c.seq_lens, 0.125, 1)
    bad = c.block_tables.clone()
    bad[1, 0] = case.kv_cache.shape[1]                                   # past the last block
    with pytest.raises(ValueError, match="block id out of range"):
        cpu_pa.paged_attention(out, case.q, case.kv_cache, bad, c.query_start_loc, c.seq_lens, 0.125, 1)
    with pytest.raises(ValueError, match="bad arguments"):              # query_len 2 > seq_len 1
        cpu_pa.paged_attention(out, case.q, case.kv_cache, c.block_tables, c.query_start_loc,
                               torch.tensor([6, 1], dtype=torch.int32), 0.125, 1)
    assert cpu_pa.supports(9, 3, 64) and cpu_pa.supports(64, 8, 128)
    assert not cpu_pa.supports(4, 4, 512) and not cpu_pa.supports(128, 1, 128)   # head_dim, G * head_dim too big
    with pytest.raises(ValueError, match="past the C paged-attention kernel's limits"):
        create_backend("torch", 2, 2, 512, 0.05, cpu_kernel=True)
    big = LlamaModelConfig(vocab_size=97, hidden_size=1024, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, head_dim=512, rms_norm_eps=1e-5,
                           rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=True)
    plan = resolve_kernel_plan(WorkerConfig(device="cpu"), torch.device("cpu"), torch.float32, big)
    assert not plan.cpu_attention_kernel and not plan.cpu_decoder                  # such a model keeps SDPA
    assert "past the kernel's limits" in dict(plan.why_off)["C attention kernel"]


def test_build_cache_key_and_failure(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(envs.CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(envs.CPU_ISA, raising=False)                     # the host's own ISA (faked below)
    path = build.build()
    assert path is not None and path.parent == tmp_path / "kernels" and path.is_file()
    assert build.build() == path and [p.name for p in path.parent.iterdir()] == [path.name]   # cached, no temp
    version = "gcc 1.0"
    monkeypatch.setattr(build, "_cpu_flags", lambda: "sse2")
    other_cpu = build.library_path(version)
    monkeypatch.setattr(build, "_cpu_flags", lambda: "sse2 avx2")
    assert build.library_path(version) != other_cpu                     # another CPU: another library
    monkeypatch.setenv("CC", "false")                                    # `false --version` fails
    with caplog.at_level(logging.WARNING):
        assert build.build() is None
    assert "not built" in caplog.text


def test_a_compile_error_is_an_error_when_strict(tmp_path, monkeypatch, caplog):
    """Serving falls back to torch with a warning; tests (strict) see the compiler's message instead."""
    monkeypatch.setenv(envs.CACHE_DIR, str(tmp_path))
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "broken-cc 1.0" && exit 0\n'
                  'echo "decoder.c:1: error: broken on purpose" >&2; exit 1\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    with pytest.raises(build.KernelBuildError, match="broken on purpose"):
        build.build(strict=True)
    with caplog.at_level(logging.WARNING):
        assert build.build() is None
    assert "broken on purpose" in caplog.text
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))                 # no compiler at all: None, even strict
    assert build.compiler() is None and build.build(strict=True) is None


def test_backend_groups_and_env_switch(monkeypatch):
    # request 1: 200 new tokens over 300 (60000 > KERNEL_MAX_CHUNK_WORK): SDPA; request 4: 40 over 43: the kernel
    case = make_case([1, 200, 8, 1, 40], [30, 100, 17, 16, 3], heads=(6, 2), seed=5)
    backend = create_backend("torch", 6, 2, 64, 0.125, cpu_kernel=True)
    assert backend.cpu_kernel is not None
    meta = backend.build_metadata(case.common)
    kinds = [type(g) for g in meta.groups]
    assert kinds == [_KernelGroup, _Group] and KERNEL_MAX_QUERY_LEN == 8 and KERNEL_MAX_CHUNK_WORK == 32768
    assert meta.groups[0].rows.tolist() == [0, *range(201, 250)]                       # requests 0, 2, 3, 4
    assert kernel_eligible(np.array([9, 128, 129, 300]), np.array([4000, 256, 256, 300])).tolist() == \
        [False, True, False, False]
    cache = case.kv_cache.clone()
    got = backend.forward(0, case.q, case.k, case.v, cache, meta)
    want = reference(case.q, cache, case.query_lens, case.seq_lens, case.block_tables, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    all_short = make_case([1, 3, 1], [4, 9, 40], heads=(6, 2), seed=6)
    (g,) = backend.build_metadata(all_short.common).groups
    assert isinstance(g, _KernelGroup) and g.rows is None                 # the whole batch: no gather of q

    assert resolve_kernel_plan(WorkerConfig(device="cpu"), torch.device("cpu"), torch.float32, TINY).cpu_attention_kernel
    monkeypatch.setenv(envs.CPU_ATTENTION_KERNEL, "0")
    plan = resolve_kernel_plan(WorkerConfig(device="cpu"), torch.device("cpu"), torch.float32, TINY)
    assert not plan.cpu_attention_kernel and dict(plan.why_off)["C attention kernel"] == "STEPLOOP_CPU_ATTENTION_KERNEL=0"
    off = create_backend("torch", 6, 2, 64, 0.125, plan.cpu_attention_kernel)
    assert off.cpu_kernel is None
    assert [type(g) for g in off.build_metadata(case.common).groups] == [_Group, _Group]
    torch.testing.assert_close(off.forward(0, case.q, case.k, case.v, case.kv_cache.clone(),
                                           off.build_metadata(case.common)), got, atol=1e-5, rtol=0)


TINY = LlamaModelConfig(vocab_size=97, hidden_size=384, intermediate_size=320, num_hidden_layers=2,
                        num_attention_heads=6, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
                        rope_theta=10000.0, max_position_embeddings=128, tie_word_embeddings=True)


def _step(model, caches, query_lens, cached, block_size=8):
    seq = [c + n for c, n in zip(cached, query_lens)]
    width = -(-max(seq) // block_size)
    tables = np.arange(1, 1 + len(seq) * width, dtype=np.int32).reshape(len(seq), width)[:, ::-1].copy()
    pos = np.concatenate([np.arange(c, s) for c, s in zip(cached, seq)])
    req = np.repeat(np.arange(len(seq)), query_lens)
    slots = tables[req, pos // block_size].astype(np.int64) * block_size + pos % block_size
    common = build_common_metadata(np.array(query_lens, np.int32), np.array(seq, np.int32), tables, slots,
                                   block_size, torch.device("cpu"))
    ids = torch.randint(0, TINY.vocab_size, (len(pos),), generator=torch.Generator().manual_seed(len(pos)))
    with torch.no_grad():
        return model(ids, torch.from_numpy(pos), caches, model.backend.build_metadata(common),
                     torch.arange(len(pos)))


def test_tiny_model_kernel_matches_sdpa_path():
    """Prompt chunks (long -> SDPA, short -> kernel), then decodes and a 4-token draft check, both paths."""
    torch.manual_seed(0)
    kernel_model = LlamaForCausalLM(TINY, create_backend("torch", 6, 2, 64, 0.125, cpu_kernel=True), 128)
    sdpa_model = LlamaForCausalLM(TINY, create_backend("torch", 6, 2, 64, 0.125), 128)
    sdpa_model.load_state_dict(kernel_model.state_dict())
    assert kernel_model.backend.cpu_kernel is not None and sdpa_model.backend.cpu_kernel is None
    caches = {m: [torch.zeros(2, 32, 8, 2, 64) for _ in range(2)] for m in (kernel_model, sdpa_model)}
    for m in caches:
        m.tie_weights()
        m.rotary.build_cache(torch.device("cpu"), torch.float32)
    for query_lens, cached in (([20, 5, 3], [0, 0, 0]), ([1, 4, 1], [20, 5, 3])):
        got, want = (_step(m, caches[m], query_lens, cached) for m in (kernel_model, sdpa_model))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
