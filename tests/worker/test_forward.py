"""The paged forward over one mixed flat batch matches transformers' LlamaForCausalLM on full sequences."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from steploop.gpu_worker.attention.metadata import build_common_metadata

pytestmark = pytest.mark.slow


def run_flat(model, kv_caches, block_size: int, chunks: list[tuple[list[int], list[int], int, int]]) -> torch.Tensor:
    """chunks: (tokens, block_ids, start, n) per request -> logits for every token of the flat batch."""
    ids = [t for tokens, _, start, n in chunks for t in tokens[start:start + n]]
    positions = np.concatenate([np.arange(start, start + n) for _, _, start, n in chunks])
    slots = np.concatenate([[blocks[p // block_size] * block_size + p % block_size
                             for p in range(start, start + n)] for _, blocks, start, n in chunks]).astype(np.int64)
    width = max(len(b) for _, b, _, _ in chunks)
    tables = np.zeros((len(chunks), width), dtype=np.int32)
    for i, (_, blocks, _, _) in enumerate(chunks):
        tables[i, :len(blocks)] = blocks
    common = build_common_metadata(np.array([n for *_, n in chunks], np.int32),
                                   np.array([s + n for *_, s, n in chunks], np.int32), tables, slots, block_size,
                                   torch.device("cpu"))
    hidden = model(torch.tensor(ids), torch.from_numpy(positions), kv_caches, model.backend.build_metadata(common),
                   torch.arange(len(ids)))
    return model.compute_logits(hidden)


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def test_mixed_batch_matches_transformers(fresh_runner, hf_model):
    model, kv, bs = fresh_runner.model, fresh_runner.kv_caches, fresh_runner.block_size
    gen = torch.Generator().manual_seed(0)
    a, b, c, d = (torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (13, 40, 31, 17))
    blocks_a, blocks_b, blocks_c, blocks_d = [7], [3, 9, 4], [12, 2], [20, 21]
    # earlier steps: b's first 21 tokens, c's first 30, d's first 16 go into the cache
    run_flat(model, kv, bs, [(b, blocks_b, 0, 21), (c, blocks_c, 0, 30), (d, blocks_d, 0, 16)])
    # the mixed step: a fresh chunk, a continued chunk crossing blocks 1 -> 2, and two decodes
    out = run_flat(model, kv, bs, [(a, blocks_a, 0, 13), (b, blocks_b, 21, 19), (c, blocks_c, 30, 1),
                                   (d, blocks_d, 16, 1)])
    expected = torch.cat([hf_logits(hf_model, a), hf_logits(hf_model, b)[21:40], hf_logits(hf_model, c)[30:31],
                          hf_logits(hf_model, d)[16:17]])
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=1e-3)
    assert (out.argmax(-1) == expected.argmax(-1)).all()
