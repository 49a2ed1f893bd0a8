"""decoder.c (all layers in one C call) against the layer-by-layer path on the real model: the same logits and the
same KV cache, bit for bit, for decodes, short chunks and prompt chunks over short contexts; a step with a long
chunk over a long context stays on the Python path."""

from __future__ import annotations

import pytest
import torch

from steploop.gpu_worker.attention.torch_backend import KERNEL_MAX_CHUNK_WORK
from steploop.gpu_worker.cpu_kernels.decoder import why_not
from tests.worker.test_forward import run_flat


@pytest.fixture
def decoder_runner(fresh_runner):
    if fresh_runner.model.cpu_decoder is None:
        pytest.fail(f"the session runner has no C decoder: {why_not(fresh_runner.model, fresh_runner.kv_caches)}")
    return fresh_runner


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def both_paths(runner, chunks):
    """(logits, KV caches) from the C decoder, then from the Python layers on the same cache state."""
    model, kv, bs = runner.model, runner.kv_caches, runner.block_size
    before = [c.clone() for c in kv]
    calls = []
    real_forward = model.cpu_decoder.forward
    model.cpu_decoder.forward = lambda *a: calls.append(1) or real_forward(*a)
    try:
        fast = run_flat(model, kv, bs, chunks)
    finally:
        del model.cpu_decoder.forward
    fast_kv = [c.clone() for c in kv]
    for c, b in zip(kv, before):
        c.copy_(b)
    decoder, model.cpu_decoder = model.cpu_decoder, None
    try:
        slow = run_flat(model, kv, bs, chunks)
    finally:
        model.cpu_decoder = decoder
    return bool(calls), fast, slow, fast_kv, [c.clone() for c in kv]


def test_decode_and_short_chunks_are_bit_identical(decoder_runner):
    a, b, c, d = tokens(40, 1), tokens(23, 2), tokens(18, 3), tokens(35, 4)
    ba, bb, bc, bd = [5, 6, 7], [10, 11], [20, 21], [25, 26, 27]
    run_flat(decoder_runner.model, decoder_runner.kv_caches, 16,
             [(a, ba, 0, 33), (b, bb, 0, 20), (c, bc, 0, 10)])                 # earlier prompt steps
    used, fast, slow, fast_kv, slow_kv = both_paths(                           # a decode, chunks of 3, 8, 35
        decoder_runner, [(a, ba, 33, 1), (b, bb, 20, 3), (c, bc, 10, 8), (d, bd, 0, 35)])
    assert used
    assert torch.equal(fast, slow)
    assert all(torch.equal(x, y) for x, y in zip(fast_kv, slow_kv))


def test_longer_chunks_take_the_python_path(decoder_runner):
    a = tokens(200, 5)
    assert 200 * 200 > KERNEL_MAX_CHUNK_WORK
    used, fast, slow, _, _ = both_paths(decoder_runner, [(a, list(range(30, 43)), 0, 200), (tokens(9, 6), [50], 0, 1)])
    assert not used and torch.equal(fast, slow)


def test_bad_slot_is_an_error_not_a_write(decoder_runner):
    model = decoder_runner.model
    common = type("Common", (), {})()
    common.num_reqs, common.num_tokens, common.max_query_len = 1, 1, 1
    common.slot_mapping = torch.tensor([10 ** 9])
    common.block_tables = torch.zeros(1, 1, dtype=torch.int32)
    common.query_start_loc = torch.tensor([0, 1], dtype=torch.int32)
    common.seq_lens = torch.tensor([1], dtype=torch.int32)
    x = model.model.embed_tokens(torch.tensor([1]))
    with pytest.raises(RuntimeError, match="out of range"):
        model.cpu_decoder.forward(x, torch.tensor([0]), common)


def test_switch_and_unsupported_models_keep_the_python_path(decoder_runner, monkeypatch):
    from steploop.common import envs
    from steploop.gpu_worker.config import WorkerConfig
    from steploop.gpu_worker.kernel_plan import resolve_kernel_plan
    model, kv = decoder_runner.model, decoder_runner.kv_caches
    assert why_not(model, kv) is None and model.plan.cpu_decoder
    monkeypatch.setenv(envs.CPU_DECODER, "0")
    plan = resolve_kernel_plan(WorkerConfig(device="cpu"), torch.device("cpu"), torch.float32, model.config)
    assert not plan.cpu_decoder and dict(plan.why_off)["C decoder"] == "STEPLOOP_CPU_DECODER=0"
    assert plan.packed_linears and plan.cpu_attention_kernel and plan.elementwise == "cpu"     # the rest stays on
    assert "contiguous fp32" in why_not(model, [c.double() for c in kv])
