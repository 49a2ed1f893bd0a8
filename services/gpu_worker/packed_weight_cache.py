"""PackedWeightCache: a checkpoint's packed linear weights on disk, so a restart reads them instead of packing again.

Packing recovers (d, m, q) for every weight of the model (8-25 s of a CPU worker's start); the result depends only
on the checkpoint, the packing code and the kernel build that reads it. So it is kept in

    $STEPLOOP_CACHE_DIR/packed-weights/<checkpoint folder hash>-<key>.safetensors

key = sha256 of: FORMAT; the kernel build id (the C library's name, which hashes every C source, the gcc flags, the
compiler and the CPU's flags) and packed_weights.py's source (the layout); the checkpoint's fingerprint, per
safetensors file: its name, size, mtime, header (every tensor's name, dtype, shape and offsets) and 16 samples of
64 KiB spread over its bytes. Hashing all of a checkpoint's bytes would cost seconds per GB at every start; the
fingerprint reads ~1 MiB per file, and any rewrite of a file changes its mtime (and nearly always its samples).

The key only finds the file; nothing in it is trusted unchecked. Packing itself keeps a packed form only when it
gives back every weight bit for bit, and the file records, per layer, the sha256 of the fp32 weight it was packed
from and of its packed tensors. On load both are hashed again: the weight just loaded from the checkpoint must be
the one that was packed, and the packed bytes the ones written (the default model: ~650 MB hashed, ~0.15 s per
GB with SHA-NI; unpacking and comparing cost 10x that). A missing, truncated, corrupt or stale file is logged,
packed again and rewritten, never used. Files are written
to a temp file and renamed into place, so workers starting at once never see half a file (the last rename wins;
both are whole). Storing removes older files of the same checkpoint folder. Layers whose weights did not pack are
recorded as such (packing them is retried only when the fingerprint changes).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from steploop.common.model_path import cache_dir
from steploop.gpu_worker.cpu_kernels import build, packed_weights
from steploop.gpu_worker.cpu_kernels.packed_weights import PackedWeight

log = logging.getLogger(__name__)

FORMAT = "steploop-packed-weights-2"
SAMPLES, SAMPLE_BYTES = 16, 64 << 10


def checkpoint_fingerprint(files: list[pathlib.Path]) -> str:
    """sha256 over each safetensors file's name, size, mtime, header and 16 sampled 64 KiB pieces."""
    h = hashlib.sha256()
    for file in files:
        stat = file.stat()
        h.update(f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f.read(min(header_len, stat.st_size)))
            for i in range(SAMPLES):
                f.seek(stat.st_size * i // SAMPLES)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def kernel_build_id() -> str:
    library = build.build()
    layout = pathlib.Path(packed_weights.__file__).read_bytes()
    return f"{library.name if library else 'unbuilt'}\0{hashlib.sha256(layout).hexdigest()}"


class PackedWeightCache:
    def __init__(self, path: pathlib.Path, key: str):
        self.path, self.key = path, key

    @classmethod
    def for_checkpoint(cls, files: list[pathlib.Path]) -> PackedWeightCache:
        key = hashlib.sha256(f"{FORMAT}\0{kernel_build_id()}\0{checkpoint_fingerprint(files)}".encode()).hexdigest()
        folder = hashlib.sha256(str(files[0].parent.resolve()).encode()).hexdigest()[:16]
        return cls(cache_dir() / "packed-weights" / f"{folder}-{key[:32]}.safetensors", key)

    def load(self, layers: dict) -> dict[str, PackedWeight | None] | None:
        """{layer name: packed weight or None} checked against the layers' loaded weights, or None (then pack)."""
        if not self.path.is_file():
            log.info("packed weights: no cache at %s", self.path)
            return None
        try:
            packed = self._read(layers)
        except Exception as exc:        # truncated, corrupt, stale: pack again (never use it)
            log.warning("packed weights: cache %s not used (%s); packing again", self.path, exc)
            return None
        return packed

    def _read(self, layers: dict) -> dict[str, PackedWeight | None]:
        with safe_open(self.path, framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT or meta.get("key") != self.key:
                raise ValueError("written for another checkpoint or kernel build")
            entries = json.loads(meta["layers"])
            if set(entries) != set(layers):
                raise ValueError("its layers are not this model's")
            packed = {name: None if entry is None else PackedWeight(
                entry["kind"], f.get_tensor(f"{name}.qs"), f.get_tensor(f"{name}.d"),
                f.get_tensor(f"{name}.m") if entry["kind"] == packed_weights.Q4_1 else None, *entry["shape"])
                for name, entry in entries.items()}
        for name, weight in packed.items():
            if weight is None:
                continue
            if _sha256(layers[name].weight.data) != entries[name]["weight_sha256"]:
                raise ValueError(f"{name} is not the checkpoint's weight it was packed from")
            if _packed_sha256(weight) != entries[name]["packed_sha256"]:
                raise ValueError(f"{name}'s packed bytes are not the ones written")
        return packed

    def store(self, packed: dict[str, PackedWeight | None], layers: dict) -> None:
        """Write atomically (temp file + rename); a cache that cannot be written is logged and skipped.
        layers: the PackedLinear modules, still holding the fp32 weights the packed forms came from."""
        tensors = {f"{name}.{part}": t.contiguous() for name, p in packed.items() if p is not None
                   for part, t in (("qs", p.qs), ("d", p.d), ("m", p.m)) if t is not None}
        entries = {name: None if p is None else {"kind": p.kind, "shape": [p.out_features, p.in_features],
                                                 "weight_sha256": _sha256(layers[name].weight.data),
                                                 "packed_sha256": _packed_sha256(p)}
                   for name, p in packed.items()}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tmp-", suffix=".safetensors")
            os.close(fd)
            try:
                save_file(tensors, tmp, metadata={"format": FORMAT, "key": self.key, "layers": json.dumps(entries)})
                os.chmod(tmp, 0o644)                     # mkstemp's 0600; other workers of the host read it
                os.replace(tmp, self.path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except OSError as exc:
            log.warning("packed weights: cache %s not written (%s)", self.path, exc)
            return
        folder = self.path.name.split("-", 1)[0]
        for old in self.path.parent.glob(f"{folder}-*.safetensors"):
            if old != self.path:
                old.unlink(missing_ok=True)


def _sha256(t: torch.Tensor) -> str:
    """sha256 of a CPU tensor's bytes and shape (hashlib reads the buffer in place, without the GIL)."""
    t = t.detach().contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


def _packed_sha256(p: PackedWeight) -> str:
    return hashlib.sha256("".join(_sha256(t) for t in (p.qs, p.d, p.m) if t is not None).encode()).hexdigest()
