"""Prefill/decode block transfer between workers over plain TCP, a CRC32 per block (common/pd_transfer.py).

    KvSender (prefill worker)    after a step's forward, reads the prompt's pool blocks (every layer's K and V of a
                                 block: one host-slot's layout), sends them to the decode worker's receiver and
                                 waits for its answer; a refusal, a timeout or a broken link is a failed send.
    KvReceiver (decode worker)   a thread per connection: reads a transfer, verifies every block's checksum and size,
                                 keeps it staged and acknowledges; a mismatch is refused (nothing staged). The
                                 scheduler then copies staged blocks into reserved host slots (`receive`, before a
                                 forward, checksums checked again) or discards them. A staged transfer no plan
                                 claims within the lease is dropped, so a scheduler that went away leaks nothing.

Wire: b"SLKV1", u32 id length, id (utf-8), u32 blocks, u64 bytes per block, then per block u32 crc32 + payload.
Answer: one byte, 1 = every checksum verified and staged, 0 = refused.
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
from steploop.common.pd_transfer import PdMoves, PdReport

log = logging.getLogger(__name__)

MAGIC = b"SLKV1"
_HEAD = struct.Struct("<IQ")


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("the peer closed the connection mid-transfer")
        buf += chunk
    return bytes(buf)


def block_bytes(caches: list[torch.Tensor], block_id: int) -> bytes:
    """Every layer's K and V of one pool block, in a host slot's layout [layers, 2, block_size, Hk, D]."""
    return torch.stack([c[:, block_id] for c in caches]).cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


class KvSender:
    def __init__(self, caches: list[torch.Tensor], timeout: float):
        self.caches, self.timeout = caches, timeout
        self.corrupt = os.environ.get(envs.TEST_CORRUPT_KV_TRANSFER, "") == "1"

    def apply(self, moves: PdMoves, report: PdReport) -> None:
        start = time.perf_counter()
        for send in moves.sends:
            try:
                report.bytes_sent += self._send(moves.address, send.transfer_id, send.block_ids)
                report.sent.append(send.transfer_id)
            except (OSError, ConnectionError, ValueError) as exc:
                log.warning("KV transfer %s to %s failed: %s", send.transfer_id, moves.address, exc)
                report.failed_sends.append(send.transfer_id)
        report.seconds += time.perf_counter() - start

    def _send(self, address: str, transfer_id: str, block_ids: list[int]) -> int:
        host, _, port = address.rpartition(":")
        blocks = [block_bytes(self.caches, b) for b in block_ids]
        size = len(blocks[0]) if blocks else 0
        tid = transfer_id.encode()
        parts = [MAGIC, struct.pack("<I", len(tid)), tid, _HEAD.pack(len(blocks), size)]
        for i, data in enumerate(blocks):
            parts.append(struct.pack("<I", zlib.crc32(data)))
            if i == 0 and self.corrupt:      # the test hook: a byte flipped in flight, after its checksum
                data = bytes([data[0] ^ 0x40]) + data[1:]
            parts.append(data)
        with socket.create_connection((host, int(port)), timeout=self.timeout) as sock:
            sock.settimeout(self.timeout)
            for part in parts:               # no joined copy of every block
                sock.sendall(part)
            answer = _read_exact(sock, 1)
        if answer != b"\x01":
            raise ValueError("the receiver refused the transfer (checksum or size mismatch)")
        return size * len(blocks)


class KvReceiver:
    def __init__(self, host: str, port: int, block_size_bytes: int, lease: float, max_blocks: int = 1 << 20):
        self.block_size_bytes, self.lease = block_size_bytes, lease
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
            count, size = _HEAD.unpack(_read_exact(sock, _HEAD.size))
            if count and size != self.block_size_bytes:      # another model or layout: refused unread
                self.refused += 1
                log.warning("KV transfer %s refused: blocks of %d bytes, this worker's are %d", tid, size,
                            self.block_size_bytes)
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

    def apply(self, moves: PdMoves, host: torch.Tensor, report: PdReport) -> None:
        """Before the forward: receives into host slots (checksums checked again), then discards."""
        with self._lock:
            for recv in moves.receives:
                _, blocks = self._staged.pop(recv.transfer_id, (0.0, []))
                for index, slot in zip(recv.indexes, recv.slots):
                    if index >= len(blocks) or zlib.crc32(blocks[index][1]) != blocks[index][0]:
                        report.failed_recv_slots.append(slot)
                        continue
                    host[slot].view(-1).view(torch.uint8).numpy()[:] = numpy.frombuffer(blocks[index][1], numpy.uint8)
            for tid in moves.discards:
                self._staged.pop(tid, None)


def apply(runner, plan) -> PdReport | None:
    """The plan's receives and discards (before the forward); sends are `send_after` (after it)."""
    moves = plan.pd_moves
    if moves is None or not (moves.receives or moves.discards):
        return None
    if runner.kv_receiver is None or runner.tiers is None:
        raise RuntimeError("the plan receives KV blocks but this worker does not receive them (--kv-role decode or both)")
    report = PdReport()
    runner.kv_receiver.apply(moves, runner.tiers.host, report)
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
