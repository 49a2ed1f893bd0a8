"""GGUF blocks read at their own width (gpu_worker/gguf/blocks.py, packed_forms.py) and the int8-block kernel kinds
(packed_linear.c steploop_packed_linear_q8b): each type's decoded d * q (+ m) equals gguf-py's dequantize bit for
bit, so does each packed form's unpack, and the kernel on the packed form matches x @ W.T (fp64) with a row's bits
independent of its batch and of the instruction set's vector width."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from steploop.gpu_worker.cpu_kernels import build
from steploop.gpu_worker.cpu_kernels import packed_linear as kernel
from steploop.gpu_worker.cpu_kernels.packed_weights import (
    Q4_1,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_0,
    Q8_0_16,
    Q8_1,
    Q8_1_16,
    SPLIT,
    unpack,
)
from steploop.gpu_worker.gguf import blocks
from steploop.gpu_worker.gguf.packed_forms import common_form, to_packed
from tests.worker.c_kernels import needs_c_kernels
from tests.worker.gguf_files import quantize

# bits a weight the k-quant forms hold (the files': 4.5, 5.5, 6.5625)
K_QUANT_BITS = {T.Q4_K: 4.75, T.Q5_K: 5.75, T.Q6_K: 6.625}
FORMS = {T.Q4_0: Q4_1, T.Q4_1: Q4_1, T.Q4_K: Q4_K, T.Q8_0: Q8_0, T.Q5_0: Q8_0, T.Q5_1: Q8_1, T.Q5_K: Q5_K,
         T.Q6_K: Q6_K}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """equal as fp32 numbers: Q4_0's d * (q - 8) is -0.0 where d < 0 and q = 8, d * q - 8 d is +0.0"""
    return torch.equal(a, b) and bool(torch.isfinite(a).all())


def gguf_tensor(qtype: T, n: int, k: int, seed: int) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return quantize(w, qtype, seed=seed)


def reference(raw: np.ndarray, qtype: T) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf_quants.dequantize(raw, qtype), dtype=np.float32))


@pytest.mark.parametrize("qtype", blocks.BLOCK_TYPES, ids=lambda t: t.name)
def test_decoded_blocks_are_gguf_pys_dequantize_bit_for_bit(qtype):
    raw = gguf_tensor(qtype, 32, 512, seed=1)
    decoded = blocks.decode(raw, qtype, 512)
    ref = reference(raw, qtype)
    assert same_values(torch.from_numpy(blocks.dequantize(decoded)), ref)
    packed = to_packed([decoded], common_form([qtype]))
    assert packed.kind == FORMS[qtype]
    assert same_values(unpack(packed), ref)
    assert packed.nbytes < ref.numel() * 4 * 0.32          # <= 10 bits a weight of fp32's 32
    if qtype in K_QUANT_BITS:                               # the k-quants at (about) their file width
        assert packed.nbytes * 8 <= ref.numel() * K_QUANT_BITS[qtype]


@pytest.mark.parametrize("types, kind", [((T.Q4_K, T.Q4_K, T.Q6_K), SPLIT), ((T.Q4_0, T.Q6_K), Q8_1_16),
                                         ((T.Q4_0, T.Q8_0), Q8_1), ((T.Q6_K, T.Q4_K, T.Q5_K, T.Q6_K), SPLIT),
                                         ((T.Q4_K, T.Q4_K), Q4_K), ((T.Q4_K, T.Q4_1), Q4_1),
                                         ((T.Q8_0, T.Q6_K), Q8_0_16), ((T.Q5_K, T.Q5_1), Q8_1),
                                         ((T.Q4_K, T.Q5_K, T.Q4_K), Q5_K), ((T.Q6_K, T.Q6_K), Q6_K)])
def test_fused_parts_of_mixed_types_take_a_common_form_exactly(types, kind):
    raws = [gguf_tensor(t, 16 * (i + 1), 256, seed=i) for i, t in enumerate(types)]
    decoded = [blocks.decode(r, t, 256) for r, t in zip(raws, types)]
    assert common_form(list(types)) == kind
    packed = to_packed(decoded, kind, list(types))
    ref = torch.cat([reference(r, t) for r, t in zip(raws, types)])
    assert packed.kind == kind and same_values(unpack(packed), ref)
    if kind == SPLIT:            # each run of k-quant parts in its own form at its width
        assert [p.kind for p in packed.parts] == [Q4_K, Q6_K] if len(types) == 3 else [Q6_K, Q5_K, Q6_K]
        form_bits = {FORMS[t]: b for t, b in K_QUANT_BITS.items()}
        assert all(p.nbytes * 8 <= form_bits[p.kind] * p.out_features * 256 for p in packed.parts)


@needs_c_kernels(build.runnable_isas())
@pytest.mark.parametrize("isa", build.runnable_isas())
@pytest.mark.parametrize("types", [(T.Q5_1,), (T.Q5_K,), (T.Q6_K,), (T.Q4_K, T.Q6_K), (T.Q4_K,), (T.Q4_K, T.Q5_K),
                                   (T.Q6_K, T.Q6_K), (T.Q4_0, T.Q6_K)], ids=lambda t: "+".join(x.name for x in t))
def test_gguf_kernel_kinds_match_matmul_and_are_batch_invariant(types, isa):
    n0, k = 32, 512           # k 512: scratch-tile k chunks at every vector width
    raws = [gguf_tensor(t, n0, k, seed=3 + i) for i, t in enumerate(types)]
    packed = to_packed([blocks.decode(r, t, k) for r, t in zip(raws, types)], common_form(list(types)), list(types))
    w = torch.cat([reference(r, t) for r, t in zip(raws, types)])
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(7))
    full = kernel.packed_linear(x, packed, num_threads=2, isa=isa)
    torch.testing.assert_close(full, (x.double() @ w.double().T).float(), rtol=1e-5, atol=2e-5)
    for m in (1, 2, 3, 8, 9, 17, 48, 49):
        assert same_bits(kernel.packed_linear(x[:m], packed, num_threads=1, isa=isa), full[:m]), m
        assert same_bits(kernel.packed_linear(x[m:m + 1], packed, num_threads=2, isa=isa), full[m:m + 1]), m
    fma_builds = [i for i in build.runnable_isas() if i in ("avx2", "avx512")]
    for o in fma_builds if isa in fma_builds else ():     # the vector width does not change a bit (fma builds)
        assert same_bits(kernel.packed_linear(x, packed, num_threads=2, isa=o), full), o


@pytest.mark.parametrize("qtype", blocks.BLOCK_TYPES, ids=lambda t: t.name)
def test_block_embedding_rows_are_gguf_pys_dequantize(qtype):
    from steploop.gpu_worker.gguf.block_embedding import BlockEmbedding
    raw = gguf_tensor(qtype, 40, 256, seed=5)
    table = BlockEmbedding(blocks.decode(raw, qtype, 256))
    ids = torch.tensor([[3, 0, 39], [7, 7, 12]])
    assert same_values(table(ids), reference(raw, qtype)[ids])
    assert table.nbytes <= raw.shape[0] * 256 * 10 / 8
    if qtype == T.Q4_K:                     # its own scales: the packed form's width (the q of 5-8 bits: a byte)
        assert table.nbytes * 8 <= raw.shape[0] * 256 * K_QUANT_BITS[qtype], table.nbytes


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q5_1], ids=lambda t: t.name)
def test_a_block_embedding_filled_in_row_chunks_holds_the_same_table(qtype):
    from steploop.gpu_worker.gguf.block_embedding import BlockEmbedding
    raw = gguf_tensor(qtype, 48, 256, seed=9)
    whole, chunked = BlockEmbedding(blocks.decode(raw, qtype, 256)), BlockEmbedding.from_blocks(raw, qtype, 256, 20)
    assert [name for name, _ in whole.named_buffers()] == [name for name, _ in chunked.named_buffers()]
    for (_, a), (_, b) in zip(whole.named_buffers(), chunked.named_buffers()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("parts", [[(T.Q4_K, 48)], [(T.Q6_K, 64)], [(T.Q5_K, 32)], [(T.Q4_K, 32), (T.Q4_K, 16)],
                                   [(T.Q4_K, 32), (T.Q5_K, 16)], [(T.Q8_0, 48)],
                                   [(T.Q4_0, 16), (T.Q4_1, 32)]], ids=str)
def test_a_weight_packed_in_row_chunks_is_the_weight_packed_whole(parts):
    """RowAssembler: chunks of 16-row groups that cut across the parts, written in place, give the tensors of the
    whole weight packed at once (every form's layout: group axis, stacked scales, bit planes)."""
    from steploop.gpu_worker.gguf.packed_chunks import RowAssembler
    decoded = [blocks.decode(gguf_tensor(t, rows, 256, seed=i), t, 256) for i, (t, rows) in enumerate(parts)]
    kind = common_form([t for t, _ in parts])
    whole = to_packed(decoded, kind)
    rows = np.cumsum([0] + [r for _, r in parts])
    assembler = RowAssembler(int(rows[-1]))
    for c0 in range(0, int(rows[-1]), 16):
        pieces = [blocks.Decoded(*(None if a is None else a[max(c0, r0) - r0:c0 + 16 - r0] for a in (d.q, d.d, d.m)),
                                 d.block, *(None if g is None else tuple(a[max(c0, r0) - r0:c0 + 16 - r0] for a in g)
                                            for g in (d.k4, d.k6)))
                  for d, r0, r1 in zip(decoded, rows[:-1], rows[1:]) if r0 < c0 + 16 and r1 > c0]
        assembler.add(to_packed(pieces, kind))
    chunked = assembler.weight()
    assert (chunked.kind, chunked.out_features, chunked.in_features) == (whole.kind, whole.out_features, 256)
    for a, b in [(whole.qs, chunked.qs), (whole.d, chunked.d), (whole.m, chunked.m)]:
        assert (a is None and b is None) or torch.equal(a, b)



def _same_packed(a, b) -> bool:
    """The same form, shape and tensors (a SPLIT weight's parts one by one)"""
    if (a.kind, a.out_features, a.in_features, a.parts is None) != (b.kind, b.out_features, b.in_features,
                                                                     b.parts is None):
        return False
    if a.parts is not None:
        return len(a.parts) == len(b.parts) and all(_same_packed(x, y) for x, y in zip(a.parts, b.parts))
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in [(a.qs, b.qs), (a.d, b.d), (a.m, b.m)])


QKV = [("q_proj", 256, T.Q4_K), ("k_proj", 128, T.Q4_K), ("v_proj", 128, T.Q6_K)]   # Q4_K_M's: a SPLIT weight


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("layer", ["qkv_proj", "down_proj"])
def test_the_loader_packs_in_row_chunks_what_to_packed_packs_whole(layer, tp, monkeypatch):
    """weights._packed_weight, a chunk of 48 rows at a time (chunks across the parts, and across a SPLIT weight's
    runs), on each tensor-parallel rank's cut of the blocks (rows of q/k/v, columns of down_proj), gives the
    tensors to_packed gives for the whole of that rank's decoded parts."""
    from types import SimpleNamespace

    from steploop.gpu_worker.gguf import weights
    from steploop.gpu_worker.gguf.block_shards import shard_raw
    from tests.tp.test_quant_shards import LLAMA, _sharders
    monkeypatch.setattr(weights, "CHUNK_WEIGHTS", 48 * 256)
    specs = QKV if layer == "qkv_proj" else [("down_proj", 256, T.Q4_K)]
    k = 256 if layer == "qkv_proj" else 512
    files = {}
    for i, (name, rows, qtype) in enumerate(specs):
        raw = gguf_tensor(qtype, rows, k, seed=i)
        hf = f"model.layers.0.{'mlp' if name == 'down_proj' else 'self_attn'}.{name}.weight"
        files[hf] = SimpleNamespace(data=raw, name=f"blk.0.{name}.weight", tensor_type=qtype, n_bytes=raw.nbytes,
                                    shape=np.array([k, rows]))
    for sharder in _sharders(LLAMA, tp) if tp > 1 else [None]:
        cuts = [shard_raw(sharder, hf, t.data, t.tensor_type, k) for hf, t in files.items()]
        local_k = cuts[0][1]
        firsts = np.cumsum([0] + [raw.shape[0] for raw, _ in cuts])
        parts = [weights._Part(t, hf, (int(r0), int(r1)) if len(files) > 1 else None, None)
                 for (hf, t), r0, r1 in zip(files.items(), firsts[:-1], firsts[1:])]
        qtypes = [t.tensor_type for t in files.values()]
        whole = to_packed([blocks.decode(raw, q, local_k) for (raw, _), q in zip(cuts, qtypes)], common_form(qtypes),
                          qtypes)
        chunked = weights._packed_weight(parts, int(firsts[-1]), local_k, "qwen2", LLAMA, weights.LoadStats(),
                                         sharder=sharder)
        assert (whole.kind == SPLIT) == (layer == "qkv_proj")
        assert _same_packed(chunked, whole)

@needs_c_kernels(build.runnable_isas())
@pytest.mark.parametrize("isa", build.runnable_isas())
@pytest.mark.parametrize("qtype, wide", [(T.Q5_K, Q8_1), (T.Q6_K, Q8_0_16)], ids=lambda t: getattr(t, "name", t))
def test_k_quant_forms_compute_the_bits_of_the_int8_form_of_the_same_values(qtype, wide, isa):
    """Q5_K / Q6_K at their width against the same weights widened to int8 blocks (the q8b kernel): the same fp32
    weights in the same fma chains, so the same bits, at register-path and tile-path batch sizes."""
    n, k = 48, 768
    decoded = blocks.decode(gguf_tensor(qtype, n, k, seed=11), qtype, k)
    narrow, int8 = to_packed([decoded], common_form([qtype])), to_packed([decoded], wide)
    assert narrow.kind != int8.kind and narrow.nbytes < 0.7 * int8.nbytes
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(13))
    for m in (1, 2, 5, 37):
        assert same_bits(kernel.packed_linear(x[:m], narrow, 2, isa=isa), kernel.packed_linear(x[:m], int8, 2, isa=isa))
