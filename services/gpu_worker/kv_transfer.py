"""Prefill/decode block transfer between workers over plain TCP, a CRC32 per block (common/pd_transfer.py).

    KvSender (prefill worker)    after a step's forward, reads the prompt's pool blocks (every layer's K and V of a
                                 block), sends them to the decode worker's receiver and waits for its answer; a
                                 refusal, a timeout or a broken link is a failed send.
    KvReceiver (decode worker)   a thread per connection: reads a transfer, verifies every block's checksum and size,
                                 keeps it staged and acknowledges; a mismatch is refused (nothing staged). The
                                 scheduler then copies staged blocks into reserved host slots (`receive`, before a
                                 forward, checksums checked again) or discards them. A staged transfer no plan
                                 claims within the lease is dropped, so a scheduler that went away leaks nothing.

Blocks travel whole: every KV head, [layers, 2, block_size, heads, head_dim] (kv_heads.py). In a tensor-parallel
group every rank takes part: a sending group's ranks gather their heads to rank 0, which sends; a receiving group's
rank 0 runs the receiver and broadcasts what it took, and each rank keeps its own heads in its host slot. So a
prefill group and a decode group of different -tp sizes exchange blocks, and the ranks agree on which arrived.

Wire: b"SLKV2", u32 id length, id (utf-8), u32 format length, format (utf-8: the cache dtype, e.g. "float32" or
"float8_e4m3fn"), u32 blocks, u64 bytes per block, then per block u32 crc32 + payload.
Answer: one byte, 1 = every checksum verified and staged, 0 = refused (a checksum, a block size or a format that
is not the receiver's: e4m3 and e5m2 blocks have the same size, not the same meaning).
"""

from __future__ import annotations

import logging
import os
import socket
import socketserver
import struct
import threading
import time
import zlib

import numpy
import torch

from steploop.common import envs
from steploop.common.pd_transfer import PdMoves, PdReceive, PdReport
from steploop.gpu_worker.kv_cache_dtype import as_bytes
from steploop.gpu_worker.kv_heads import KvHeads

log = logging.getLogger(__name__)

MAGIC = b"SLKV2"
_HEAD = struct.Struct("<IQ")


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("the peer closed the connection mid-transfer")
        buf += chunk
    return bytes(buf)


def kv_format(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def local_blocks(caches: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """This rank's heads of the pool blocks, [blocks, layers, 2, block_size, heads here, head_dim] (an FP8 cache's
    as their bytes)."""
    caches = [as_bytes(c) for c in caches]
    return torch.stack([torch.stack([c[:, b] for c in caches]) for b in block_ids])


class KvSender:
    """On every rank of a sending group; rank 0 holds the link (the others only give it their heads)."""

    def __init__(self, caches: list[torch.Tensor], timeout: float, comm=None, heads: KvHeads | None = None):
        self.caches, self.timeout = caches, timeout
        self.comm, self.heads = comm, heads
        self.corrupt = os.environ.get(envs.TEST_CORRUPT_KV_TRANSFER, "") == "1"

    @property
    def rank(self) -> int:
        return self.comm.rank if self.comm is not None else 0

    def whole_blocks(self, block_ids: list[int]) -> torch.Tensor | None:
        """The blocks with every KV head, on rank 0 (host memory); None on the other ranks. A collective in a
        group: every rank calls it for the same blocks in the same order."""
        local = local_blocks(self.caches, block_ids)
        parts = self.comm.gather_to_first(local) if self.comm is not None else [local]
        if parts is None:
            return None
        whole = self.heads.whole(parts) if self.heads is not None else parts[0]
        return whole.cpu().contiguous()

    def apply(self, moves: PdMoves, report: PdReport) -> None:
        start = time.perf_counter()
        wholes = [self.whole_blocks(send.block_ids) if send.block_ids else None for send in moves.sends]
        if self.rank != 0:
            return
        for send, whole in zip(moves.sends, wholes):
            try:
                report.bytes_sent += self._send(moves.address, send.transfer_id, whole)
                report.sent.append(send.transfer_id)
            except (OSError, ConnectionError, ValueError) as exc:
                log.warning("KV transfer %s to %s failed: %s", send.transfer_id, moves.address, exc)
                report.failed_sends.append(send.transfer_id)
        report.seconds += time.perf_counter() - start

    def _send(self, address: str, transfer_id: str, whole: torch.Tensor | None) -> int:
        host, _, port = address.rpartition(":")
        flat = whole.view(whole.shape[0], -1).view(torch.uint8).numpy() if whole is not None else ()
        size = flat.shape[1] if whole is not None else 0
        tid = transfer_id.encode()
        fmt = kv_format(self.caches[0].dtype).encode()
        parts = [MAGIC, struct.pack("<I", len(tid)), tid, struct.pack("<I", len(fmt)), fmt, _HEAD.pack(len(flat), size)]
        for i, row in enumerate(flat):
            data = row.data
            parts.append(struct.pack("<I", zlib.crc32(data)))
            if i == 0 and self.corrupt:      # the test hook: a byte flipped in flight, after its checksum
                data = bytes([row[0] ^ 0x40]) + row[1:].tobytes()
            parts.append(data)
        with socket.create_connection((host, int(port)), timeout=self.timeout) as sock:
            sock.settimeout(self.timeout)
            for part in parts:               # no joined copy of every block
                sock.sendall(part)
            answer = _read_exact(sock, 1)
        if answer != b"\x01":
            raise ValueError("the receiver refused the transfer (checksum or size mismatch)")
        return size * len(flat)


class KvReceiver:
    def __init__(self, host: str, port: int, block_size_bytes: int, lease: float, max_blocks: int = 1 << 20,
                 dtype: torch.dtype = torch.float32):
        self.block_size_bytes, self.lease = block_size_bytes, lease
        self.format = kv_format(dtype)        # what the blocks must hold (the cache dtype)
        self.max_blocks = max_blocks          # staged at most (the host slots they could land in): more is refused
        self._staged: dict[str, tuple[float, list[tuple[int, bytes]]]] = {}
        self._lock = threading.Lock()
        self.refused = 0
        receiver = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                receiver._handle(self.request)

        self._server = socketserver.ThreadingTCPServer((host, port), Handler, bind_and_activate=False)
        self._server.allow_reuse_address = True
        self._server.daemon_threads = True
        self._server.server_bind()
        self._server.server_activate()
        self.address = f"{host}:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, name="kv-receiver", daemon=True).start()
        log.info("KV transfer receiver on %s", self.address)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handle(self, sock: socket.socket) -> None:
        sock.settimeout(60.0)
        try:
            if _read_exact(sock, len(MAGIC)) != MAGIC:
                raise ValueError("not a KV transfer")
            (n,) = struct.unpack("<I", _read_exact(sock, 4))
            tid = _read_exact(sock, n).decode()
            (n,) = struct.unpack("<I", _read_exact(sock, 4))
            fmt = _read_exact(sock, n).decode()
            count, size = _HEAD.unpack(_read_exact(sock, _HEAD.size))
            if count and (size != self.block_size_bytes or fmt != self.format):   # another model or layout
                self.refused += 1
                log.warning("KV transfer %s refused: blocks of %d bytes of %s, this worker's are %d of %s", tid,
                            size, fmt, self.block_size_bytes, self.format)
                sock.sendall(b"\x00")
                return
            ok, blocks = True, []
            for _ in range(count):
                (crc,) = struct.unpack("<I", _read_exact(sock, 4))
                data = _read_exact(sock, size)
                ok = ok and zlib.crc32(data) == crc
                blocks.append((crc, data))
            if not ok:
                self.refused += 1
                log.warning("KV transfer %s refused: checksum mismatch", tid)
            else:
                with self._lock:
                    self._expire()
                    staged = sum(len(b) for _, b in self._staged.values())
                    ok = staged + count <= self.max_blocks
                    if ok:
                        self._staged[tid] = (time.monotonic(), blocks)
                if not ok:
                    self.refused += 1
                    log.warning("KV transfer %s refused: %d blocks staged already, at most %d", tid, staged,
                                self.max_blocks)
            sock.sendall(b"\x01" if ok else b"\x00")
        except (OSError, ConnectionError, ValueError, UnicodeDecodeError) as exc:
            log.warning("KV transfer connection failed: %s", exc)

    def _expire(self) -> None:
        now = time.monotonic()
        for tid in [t for t, (at, _) in self._staged.items() if now - at > self.lease]:
            log.warning("KV transfer %s dropped: no plan claimed it within its %g s lease", tid, self.lease)
            del self._staged[tid]

    def num_staged(self) -> int:
        with self._lock:
            return len(self._staged)

    def take(self, recv: PdReceive, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A staged transfer's blocks for a plan's receive, (whole blocks [slots, *shape], ok [slots] int32): a
        block absent or whose checksum no longer matches is not ok (its slot is reported failed)."""
        whole = torch.zeros((len(recv.slots), *shape), dtype=dtype)
        ok = torch.zeros(len(recv.slots), dtype=torch.int32)
        with self._lock:
            _, blocks = self._staged.pop(recv.transfer_id, (0.0, []))
        flat = whole.reshape(len(recv.slots), -1).view(torch.uint8).numpy() if recv.slots else ()
        for i, index in enumerate(recv.indexes):
            if index < len(blocks) and zlib.crc32(blocks[index][1]) == blocks[index][0] and \
                    len(blocks[index][1]) == flat.shape[1]:
                flat[i] = numpy.frombuffer(blocks[index][1], numpy.uint8)
                ok[i] = 1
        return whole, ok

    def discard(self, transfer_ids: list[str]) -> None:
        with self._lock:
            for tid in transfer_ids:
                self._staged.pop(tid, None)


def apply(runner, plan) -> PdReport | None:
    """The plan's receives and discards (before the forward); sends are `send_after` (after it)."""
    moves = plan.pd_moves
    if moves is None or not (moves.receives or moves.discards):
        return None
    comm = runner.tp_comm
    if runner.tiers is None or ((comm is None or comm.rank == 0) and runner.kv_receiver is None):
        raise RuntimeError("the plan receives KV blocks but this worker does not receive them (--kv-role decode or both)")
    return receive(moves, runner.tiers.host, runner.kv_receiver, comm, runner.kv_heads, runner.kv_caches[0].device)


def receive(moves: PdMoves, host: torch.Tensor, receiver: KvReceiver | None, comm=None, heads: KvHeads | None = None,
            device: torch.device | None = None) -> PdReport:
    """Receives into host slots [slots, layers, 2, block_size, heads here, head_dim], then discards. Every rank of
    a receiving group takes part: rank 0's receiver takes the staged blocks, a broadcast gives every rank the same
    blocks and the same verdicts, and each rank copies its heads into its slots."""
    rank = comm.rank if comm is not None else 0
    report = PdReport()
    shape = (*host.shape[1:-2], heads.total if heads is not None else host.shape[-2], host.shape[-1])
    for recv in moves.receives:
        if rank == 0:
            whole, ok = receiver.take(recv, shape, host.dtype)
        else:
            whole = torch.empty((len(recv.slots), *shape), dtype=host.dtype)
            ok = torch.empty(len(recv.slots), dtype=torch.int32)
        if comm is not None and comm.world_size > 1 and recv.slots:   # NCCL broadcasts device tensors, gloo host
            whole = comm.broadcast_from_first(whole.to(device or host.device))
            ok = comm.broadcast_from_first(ok.to(device or host.device))
        mine = heads.mine(whole, rank) if heads is not None else whole
        for i, (slot, arrived) in enumerate(zip(recv.slots, ok.tolist())):
            if arrived:
                host[slot].copy_(mine[i])
            else:
                report.failed_recv_slots.append(slot)
    if rank == 0:
        receiver.discard(moves.discards)
    return report


def send_after(runner, plan, report: PdReport | None) -> PdReport | None:
    moves = plan.pd_moves
    if moves is None or not moves.sends:
        return report
    if runner.kv_sender is None:
        raise RuntimeError("the plan sends KV blocks but this worker does not send them (--kv-role prefill or both)")
    report = report or PdReport()
    runner.kv_sender.apply(moves, report)
    return report
