"""One tensor-parallel rank's share of a GGUF tensor, cut from its raw blocks (never dequantized to cut it).

A column-parallel weight (q/k/v, gate/up, each expert's gate/up) keeps whole rows: any row range is whole blocks.
A row-parallel weight (o_proj, down_proj, each expert's down) keeps a range of input columns, which must start and
end on the type's block boundary (32 weights for the legacy types, a 256-weight super-block for the k-quants): a
weight whose cut does not (cut_inside_blocks) is left to the fp32 path by the loader, so here it is a bug. The vocabulary
tensors (embedding, output) take the rank's rows, padded with zero bytes, which every type decodes to 0.0 (d = 0).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES

_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def block_size(qtype) -> int:
    """Weights per block along a row (1 for the float types)."""
    return GGML_QUANT_SIZES[qtype][0]


def misaligned(start: int, size: int, qtype) -> bool:
    return bool(start % block_size(qtype) or size % block_size(qtype))


def cut_inside_blocks(sharder, hf_name: str, qtype) -> bool:
    """True when this rank's share of a row-parallel weight starts or ends inside one of its blocks."""
    split = None if sharder is None or block_size(qtype) == 1 else sharder.split(hf_name)
    return split is not None and split[0] == 1 and misaligned(split[1], split[2], qtype)


def shard_raw(sharder, hf_name: str, data: np.ndarray, qtype, k: int) -> tuple[np.ndarray, int]:
    """(this rank's raw rows of `data`, its row length in weights). data: [rows, row units] as the reader maps
    it (bytes for the block types, elements for the float ones) whose rows hold k weights."""
    if sharder is None:
        return data, k
    if hf_name in _VOCAB:
        share = sharder.share
        part = data[share.first_vocab_row:share.first_vocab_row + share.vocab_rows]
        if part.shape[0] < share.vocab_rows:
            part = np.concatenate([part, np.zeros((share.vocab_rows - part.shape[0], *data.shape[1:]), data.dtype)])
        return part, k
    split = sharder.split(hf_name)
    if split is None:
        return data, k
    dim, start, size = split
    if dim == 0:
        return data[start:start + size], k
    if misaligned(start, size, qtype):
        raise ValueError(f"{hf_name}: columns [{start}, {start + size}) of {k} are not whole {qtype.name} blocks of "
                         f"{block_size(qtype)} (the loader should have read it as fp32)")
    per_block = data.shape[-1] // (k // block_size(qtype))
    first = start // block_size(qtype) * per_block
    return data[..., first:first + size // block_size(qtype) * per_block], size
