"""llama.cpp's multi-sequence batching (benchmarks/llama_cpp_baseline.batched) on the GGUF: exact output lengths,
slots reused as requests finish, and (with a KV stream per sequence) the same greedy tokens as one sequence at a
time through the same path.
Skipped without llama-cpp-python or the GGUF; a few seconds on 2 cores."""

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from benchmarks.llama_cpp_baseline import batched


@pytest.fixture(scope="module")
def prompts():
    from steploop.gpu_worker.gguf_convert import find_gguf
    try:
        find_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return [([100 + 7 * i + j for j in range(5 + 3 * i)], 2 + (i * 5) % 7) for i in range(5)]


@pytest.mark.parametrize("kv_unified", [True, False])
def test_batched_lengths_are_exact(prompts, kv_unified):
    many = batched(prompts, n_parallel=2, threads=1, kv_unified=kv_unified)   # 5 requests on 2 slots: reused
    assert many["requests"] == 5 and many["streams"] == 2
    assert [len(o) for o in many["_outputs"]] == [n for _, n in prompts]
    assert many["output_tokens"] == sum(n for _, n in prompts)
    assert many["decode_calls"] < many["output_tokens"]     # several sequences per llama_decode
    assert many["mean_ttft_ms"] > 0 and many["output_throughput"] > 0
    if not kv_unified:              # a KV stream per sequence: batching changes no sums, so no tokens
        one = batched(prompts, n_parallel=1, threads=1, kv_unified=False)
        assert one["decode_calls"] == one["output_tokens"]
        assert one["_outputs"] == many["_outputs"]
