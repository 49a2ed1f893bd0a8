"""Small GGUF files broken on purpose (tests of gguf/reader.py's checks): one tensor's type field set to a number
gguf-py does not know, the file cut short, a tensor's shape grown past its bytes."""

from __future__ import annotations

import pathlib
import struct


def tensor_info_offset(data: bytes, name: str) -> int:
    """Offset of the tensor info record's n_dims field for `name` (after its length-prefixed name)."""
    needle = struct.pack("<Q", len(name)) + name.encode()
    at = data.find(needle)
    assert at >= 0, name
    return at + len(needle)


def with_type(path: pathlib.Path, name: str, raw_type: int) -> None:
    data = bytearray(path.read_bytes())
    at = tensor_info_offset(data, name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, raw_type)
    path.write_bytes(bytes(data))


def with_extra_rows(path: pathlib.Path, name: str, extra: int) -> None:
    """Grow a 2-D tensor's row count (ne[1]) without moving any bytes (one row is more than the 32-byte
    alignment padding between tensors)."""
    data = bytearray(path.read_bytes())
    at = tensor_info_offset(data, name)
    struct.pack_into("<Q", data, at + 4 + 8, struct.unpack_from("<Q", data, at + 4 + 8)[0] + extra)
    path.write_bytes(bytes(data))


def truncated(path: pathlib.Path, cut: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:-cut])


def first_2d_tensor(path: pathlib.Path) -> str:
    """The 2-D tensor stored first in the file (another one's bytes follow it)."""
    from gguf import GGUFReader
    reader = GGUFReader(str(path))
    return next(t.name for t in sorted(reader.tensors, key=lambda t: t.data_offset) if len(t.shape) == 2)
