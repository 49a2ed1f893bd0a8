"""The disk tier's files: one per KV block, named by its prefix hash, under a folder named by a fingerprint of what
makes KV bytes interchangeable (model, dtype, block size, cache layout). A file carries a header (magic,
fingerprint, block hash, payload length) and a BLAKE2b checksum of its payload; anything that does not check out
(truncated, corrupted, from another model or layout, absent) is a miss and a log line, never KV. A write that
fails (disk full, I/O error) is reported; serving goes on and the block is simply recomputed when needed.

Files are written to a temporary name and renamed into place, so a worker killed mid-write leaves no half file
under a block's name. The folder survives restarts: `hashes()` lists what is there, oldest first, for the hello.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import struct

log = logging.getLogger(__name__)

MAGIC = b"SLKVBLK1"
HEADER = struct.Struct("<8s32s32sQ32s")     # magic, fingerprint, block hash, payload bytes, checksum
SUFFIX = ".kvb"


def fingerprint(*parts: object) -> bytes:
    """What must match for two workers' block bytes to be interchangeable."""
    return hashlib.sha256("\x00".join(str(p) for p in parts).encode()).digest()


def checksum(payload) -> bytes:
    return hashlib.blake2b(payload, digest_size=32).digest()


class DiskTier:
    def __init__(self, root: str | os.PathLike, fp: bytes, payload_bytes: int) -> None:
        self.fingerprint, self.payload_bytes = fp, payload_bytes
        self.folder = pathlib.Path(root) / fp.hex()[:32]
        self.folder.mkdir(parents=True, exist_ok=True)
        self.misses = 0

    @property
    def file_bytes(self) -> int:
        return HEADER.size + self.payload_bytes

    def path(self, key: bytes) -> pathlib.Path:
        return self.folder / (key.hex() + SUFFIX)

    def hashes(self) -> list[bytes]:
        """Block hashes with a file here, least recently written first (temporary leftovers are removed)."""
        found = []
        for p in self.folder.iterdir():
            if p.suffix != SUFFIX:
                p.unlink(missing_ok=True)           # a write cut short by a kill
                continue
            try:
                found.append((p.stat().st_mtime_ns, bytes.fromhex(p.stem)))
            except (ValueError, OSError):
                continue
        return [key for _, key in sorted(found)]

    def write(self, key: bytes, payload) -> bool:
        """False (and a log line) when the file could not be written: the block is then not on disk."""
        path = self.path(key)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(HEADER.pack(MAGIC, self.fingerprint, key, len(payload), checksum(payload)))
                f.write(payload)
            os.replace(tmp, path)
            return True
        except OSError as exc:
            log.warning("KV disk tier: cannot write block %s (%s); it will be recomputed when needed",
                        key.hex()[:16], exc)
            tmp.unlink(missing_ok=True)
            return False

    def read(self, key: bytes) -> bytes | None:
        """The block's payload, or None (a miss, logged; a bad file is removed)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError as exc:
            return self._miss(key, f"cannot read ({exc})", None)
        if len(data) < HEADER.size:
            return self._miss(key, "truncated header", path)
        magic, fp, stored_key, n, digest = HEADER.unpack_from(data)
        payload = data[HEADER.size:]
        if magic != MAGIC or fp != self.fingerprint or stored_key != key:
            return self._miss(key, "foreign file (another model, dtype, block size or layout)", path)
        if n != self.payload_bytes or len(payload) != n:
            return self._miss(key, f"truncated ({len(payload)} of {self.payload_bytes} payload bytes)", path)
        if checksum(payload) != digest:
            return self._miss(key, "checksum mismatch", path)
        try:
            os.utime(path)                          # read = used: the restart listing is in LRU order
        except OSError:
            pass
        return payload

    def drop(self, key: bytes) -> None:
        self.path(key).unlink(missing_ok=True)

    def _miss(self, key: bytes, why: str, path: pathlib.Path | None) -> None:
        self.misses += 1
        log.warning("KV disk tier: block %s is a miss: %s; recomputing it", key.hex()[:16], why)
        if path is not None:
            path.unlink(missing_ok=True)
