"""Llama-shaped Q4_K_M-like GGUF files of random valid blocks for the GGUF benchmarks (gguf_memory.py,
gguf_vs_llamacpp.py, gguf_serve_memory.py): the types llama.cpp's Q4_K_M gives a Llama (llama-quant.cpp): Q4_K,
with Q6_K for the output and for attn_v and ffn_down in the layers use_more_bits picks (the first and last eighth
and every third between: 16 of 32), F32 norms; the default model's tokenizer (padded with unreachable tokens up to
the shape's vocabulary). The 8B shape comes out at 4.9 GB, as a real Llama-3.1-8B Q4_K_M file.

Written tensor by tensor (header and tensor infos first, then each tensor's blocks as they are drawn): one tensor's
bytes in memory at a time, so an 8B-shaped file (~4.9 GB) is written without holding it, let alone an fp32 copy.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    mlp: int
    heads: int
    kv_heads: int
    layers: int
    vocab: int
    context: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "1b": Shape("llama-1b-shaped", 2048, 8192, 32, 8, 16, 49152, 2048),        # Llama-3.2-1B, the default vocab
    "8b": Shape("llama-8b-shaped", 4096, 14336, 32, 8, 32, 128256, 8192),      # Llama-3.1-8B
}


def file_name(shape: Shape) -> str:
    return f"{shape.name}-{shape.layers}l-q4_k_m-v2.gguf"     # v2: use_more_bits (v1 had Q6_K in every layer)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get Q6_K in a Q4_K_M file."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _tensors(shape: Shape):
    """(name, rows, cols, GGUF type or None for an F32 vector) in file order, as llama.cpp orders them."""
    from gguf import GGMLQuantizationType as T
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    yield "token_embd.weight", shape.vocab, h, T.Q4_K
    for i in range(shape.layers):
        p, wide = f"blk.{i}.", T.Q6_K if use_more_bits(i, shape.layers) else T.Q4_K
        yield p + "attn_norm.weight", 1, h, None
        yield p + "ffn_norm.weight", 1, h, None
        yield p + "attn_q.weight", q, h, T.Q4_K
        yield p + "attn_k.weight", kv, h, T.Q4_K
        yield p + "attn_v.weight", kv, h, wide
        yield p + "attn_output.weight", h, q, T.Q4_K
        yield p + "ffn_gate.weight", shape.mlp, h, T.Q4_K
        yield p + "ffn_up.weight", shape.mlp, h, T.Q4_K
        yield p + "ffn_down.weight", h, shape.mlp, wide
    yield "output_norm.weight", 1, h, None
    yield "output.weight", shape.vocab, h, T.Q6_K


def write_file(path: pathlib.Path, shape: Shape, tokenizer_dir: pathlib.Path) -> None:
    """Write the file at `path` (into a temporary sibling renamed into place: a killed run leaves no half file)."""
    import gguf

    from tests.worker.gguf_files import _add_tokenizer, add_shape, quantize
    tmp = path.with_name(path.name + ".part")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    add_shape(writer, shape.name, shape.context, shape.hidden, shape.layers, shape.mlp, shape.heads, shape.kv_heads,
              shape.head_dim, 1e-5, 500000.0, shape.vocab)
    _add_tokenizer(writer, tokenizer_dir, unigram=False, vocab_size=shape.vocab)
    tensors = list(_tensors(shape))
    for name, rows, cols, qtype in tensors:
        if qtype is None:
            writer.add_tensor_info(name, (cols,), np.dtype(np.float32), cols * 4)
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            writer.add_tensor_info(name, (rows, cols // block * size), np.dtype(np.uint8),
                                   rows * cols // block * size, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for seed, (name, rows, cols, qtype) in enumerate(tensors):
        if qtype is None:
            writer.write_tensor_data(np.ones(cols, np.float32))
        else:   # quantize() only reads the shape for the k-quants (random valid blocks): a view, no memory
            shaped = np.broadcast_to(np.float32(0), (rows, cols))
            writer.write_tensor_data(quantize(shaped, qtype, seed))
    writer.close()
    tmp.rename(path)


def ensure_file(folder: pathlib.Path, shape: Shape) -> pathlib.Path:
    """The shape's file in `folder`, written on first use."""
    from steploop.common.model_path import default_model_dir
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file_name(shape)
    if not path.is_file():
        write_file(path, shape, default_model_dir())
    return path
