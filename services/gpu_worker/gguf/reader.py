"""Open a GGUF file memory-mapped (gguf-py's GGUFReader), refusing before any weight is used what steploop cannot
read right: a tensor type it does not read (or that gguf-py does not know), a tensor whose shape does not fit its
type's blocks, a tensor whose bytes (shape x type) run past the file's end (a truncated file) or into the next
tensor's. Each raises GGUFFileError naming the tensor and type; the worker exits with code 2 on it."""

from __future__ import annotations

import contextlib
import math
import pathlib
import struct

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from steploop.gpu_worker.gguf.blocks import SUPPORTED

# GGUF architectures whose tensors transformers' reader takes as stored (no TensorProcessor), with llama's q/k
# permutation, or with Gemma 2/3's norms stored as 1 + w (weights.py undoes both as transformers does): these load
# directly (gguf/weights.py), Qwen2/3-MoE's stacked experts split per expert there; others (Gemma 1) go through the
# fp32 conversion (gguf_convert.py), which dequantizes whatever gguf-py knows
DIRECT_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen2moe", "qwen3moe")


class GGUFFileError(ValueError):
    pass


def _type_names() -> str:
    return ", ".join(t.name for t in SUPPORTED)


class FastReader(GGUFReader):
    """GGUFReader whose reads slice a plain ndarray view of the mapping, not the np.memmap itself: gguf-py reads
    every metadata string and array element with its own slice, and a memmap slice pays for a memmap subclass
    instance (__array_finalize__) each time. A 49k-token vocabulary with its merges took 4.9 s to open, 1.7 s so.
    The same bytes, the same values; `data` stays the memmap (file_pages.py advises on its mapping)."""

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


@contextlib.contextmanager
def fast_gguf_readers():
    """transformers' GGUF loading (config, tokenizer, weights: load_gguf_checkpoint imports gguf.GGUFReader when
    called) opens the file with FastReader meanwhile. For the start-up conversion, on one thread."""
    import gguf
    saved, gguf.GGUFReader = gguf.GGUFReader, FastReader
    try:
        yield
    finally:
        gguf.GGUFReader = saved


class CheckedReader(FastReader):
    """GGUFReader that checks every tensor's type and byte range before gguf-py maps it."""

    def _build_tensors(self, start_offs: int, fields) -> None:
        direct = architecture(self) in DIRECT_ARCHITECTURES
        spans = []
        for field in fields:
            _name_len, name_data, _n_dims, dims, raw_dtype, offset = field.parts
            name = bytes(name_data).decode("utf-8", "replace")
            raw = int(raw_dtype[0])
            try:
                qtype = GGMLQuantizationType(raw)
            except ValueError:
                raise GGUFFileError(f"tensor {name!r} has GGUF tensor type {raw}, which is unknown (steploop reads "
                                    f"{_type_names()})") from None
            if qtype not in SUPPORTED and direct:
                raise GGUFFileError(f"tensor {name!r} has GGUF tensor type {qtype.name}, which steploop does not "
                                    f"read (it reads {_type_names()})")
            block, type_size = GGML_QUANT_SIZES[qtype]
            ne = [int(x) for x in dims]
            if not ne or min(ne) <= 0 or ne[0] % block:
                raise GGUFFileError(f"tensor {name!r}: shape {ne[::-1]} does not fit {qtype.name} blocks of "
                                    f"{block} weights along its rows")
            spans.append((start_offs + int(offset[0]), math.prod(ne) // block * type_size, name, qtype, ne))
        size = len(self.data)
        spans.sort()
        for i, (start, nbytes, name, qtype, ne) in enumerate(spans):
            what = f"tensor {name!r} ({qtype.name} {ne[::-1]}: {nbytes} bytes at offset {start})"
            if start + nbytes > size:
                raise GGUFFileError(f"{what} runs past the end of the file ({size} bytes): truncated?")
            if i + 1 < len(spans) and start + nbytes > spans[i + 1][0]:
                raise GGUFFileError(f"{what} overlaps tensor {spans[i + 1][2]!r} at offset {spans[i + 1][0]}: its "
                                    f"size does not match its shape and type")
        super()._build_tensors(start_offs, fields)


def open_gguf(path: pathlib.Path | str) -> GGUFReader:
    """The file's reader (tensors memory-mapped, read-only); GGUFFileError if it cannot be served as is."""
    try:
        return CheckedReader(str(path), "r")
    except GGUFFileError as exc:
        raise GGUFFileError(f"{path}: {exc}") from None
    except (ValueError, IndexError, KeyError, TypeError, struct.error, OSError) as exc:     # a cut or foreign header
        raise GGUFFileError(f"{path}: not a readable GGUF file (truncated or corrupt header?): "
                            f"{type(exc).__name__}: {exc}") from None


def architecture(reader: GGUFReader) -> str:
    field = reader.fields.get("general.architecture")
    return bytes(field.parts[field.data[0]]).decode() if field is not None else ""
