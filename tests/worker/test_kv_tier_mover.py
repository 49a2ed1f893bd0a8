"""The worker's KV tiers: pool <-> host copies, host <-> disk files, and every way a file can be bad (a miss and a
log line, never bytes) or a write can fail (reported, the worker goes on)."""

from __future__ import annotations

import errno
import logging

import pytest
import torch

from steploop.common.kv_moves import KvMoves
from steploop.gpu_worker.kv_disk_tier import DiskTier, fingerprint
from steploop.gpu_worker.kv_tier_mover import KvTierMover

LAYERS, BLOCKS, BS, HK, D = 3, 10, 4, 2, 8


def make_mover(tmp_path=None, fp=b"x" * 32, host=6) -> KvTierMover:
    torch.manual_seed(0)
    caches = [torch.randn(2, BLOCKS, BS, HK, D) for _ in range(LAYERS)]
    disk = None
    if tmp_path is not None:
        disk = DiskTier(tmp_path, fp, 2 * BS * HK * D * LAYERS * 4)
    return KvTierMover(caches, host, disk, disk_blocks=100)


def block(mover: KvTierMover, b: int) -> torch.Tensor:
    return torch.stack([c[:, b] for c in mover.caches])


def test_store_then_load_restores_every_layer_k_and_v():
    mover = make_mover()
    want = {b: block(mover, b).clone() for b in (3, 7)}
    mover.apply(KvMoves(stores=[(3, 0), (7, 5)]))
    for c in mover.caches:
        c[:, 3] = 0.0                             # the pool reuses the blocks
        c[:, 7] = 0.0
    report = mover.apply(KvMoves(loads=[(5, 1), (0, 2)]))
    assert torch.equal(block(mover, 1), want[7]) and torch.equal(block(mover, 2), want[3])
    assert not report.failed_promote_slots and report.seconds > 0


def test_store_reads_the_block_before_a_load_of_the_same_step_overwrites_it():
    """The scheduler may reuse a demoted block as a restore target in the same plan."""
    mover = make_mover()
    old, other = block(mover, 4).clone(), block(mover, 6).clone()
    mover.apply(KvMoves(stores=[(6, 2)]))
    mover.apply(KvMoves(stores=[(4, 1)], loads=[(2, 4)]))
    assert torch.equal(block(mover, 4), other)
    mover.apply(KvMoves(loads=[(1, 9)]))
    assert torch.equal(block(mover, 9), old)


def test_disk_round_trip_through_host(tmp_path):
    mover = make_mover(tmp_path)
    want = block(mover, 2).clone()
    key = b"k" * 32
    mover.apply(KvMoves(stores=[(2, 0)]))
    mover.apply(KvMoves(demotes=[(0, key)]))
    assert mover.disk_hashes() == [key]
    report = mover.apply(KvMoves(promotes=[(key, 3)], ))
    assert not report.failed_promote_slots
    mover.apply(KvMoves(loads=[(3, 8)]))
    assert torch.equal(block(mover, 8), want)
    mover.apply(KvMoves(disk_drops=[key]))
    assert mover.disk_hashes() == []


def _written(tmp_path, fp=b"x" * 32):
    mover = make_mover(tmp_path, fp)
    key = b"h" * 32
    mover.apply(KvMoves(stores=[(1, 0)], demotes=[]))
    mover.apply(KvMoves(demotes=[(0, key)]))
    return mover, key, mover.disk.path(key)


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "absent"])
def test_bad_file_is_a_logged_miss(tmp_path, caplog, damage):
    mover, key, path = _written(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-10] ^= 0x40
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:-100]))
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        path.unlink()
    with caplog.at_level(logging.WARNING, "steploop.gpu_worker.kv_disk_tier"):
        report = mover.apply(KvMoves(promotes=[(key, 4)]))
    assert report.failed_promote_slots == [4]
    assert "is a miss" in caplog.text
    assert not path.exists(), "a bad file is set aside, not read again"


def test_foreign_file_is_a_miss(tmp_path, caplog):
    """Same folder name, another model's fingerprint in the header (or a file copied in from elsewhere)."""
    mover, key, _ = _written(tmp_path)
    other = DiskTier(tmp_path, b"y" * 32, mover.disk.payload_bytes)
    other.folder = mover.disk.folder
    with caplog.at_level(logging.WARNING):
        assert other.read(key) is None
    assert "foreign" in caplog.text


def test_fingerprint_separates_models_dtypes_and_layouts(tmp_path):
    a = fingerprint("m1", "torch.float32", 16, "layout")
    assert len({a, fingerprint("m2", "torch.float32", 16, "layout"), fingerprint("m1", "torch.bfloat16", 16, "layout"),
                fingerprint("m1", "torch.float32", 32, "layout"), fingerprint("m1", "torch.float32", 16, "x")}) == 5
    assert DiskTier(tmp_path, a, 8).folder != DiskTier(tmp_path, fingerprint("m2"), 8).folder


def test_disk_full_is_reported_and_the_worker_goes_on(tmp_path, monkeypatch, caplog):
    mover = make_mover(tmp_path)
    mover.apply(KvMoves(stores=[(1, 0)]))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("builtins.open", full)
    with caplog.at_level(logging.WARNING):
        report = mover.apply(KvMoves(demotes=[(0, b"z" * 32)], loads=[(0, 5)]))
    monkeypatch.undo()
    assert report.failed_demote_hashes == [b"z" * 32]
    assert "No space left" in caplog.text
    assert torch.equal(block(mover, 5), block(mover, 1)), "the step's other moves still ran"
    assert mover.disk_hashes() == []


def test_restart_lists_files_oldest_first_and_clears_half_writes(tmp_path):
    mover = make_mover(tmp_path)
    mover.apply(KvMoves(stores=[(1, 0), (2, 1)]))
    mover.apply(KvMoves(demotes=[(0, b"a" * 32)]))
    mover.apply(KvMoves(demotes=[(1, b"b" * 32)]))
    (mover.disk.folder / "cut.tmp").write_bytes(b"half")
    again = DiskTier(tmp_path, b"x" * 32, mover.disk.payload_bytes)
    assert again.hashes() == [b"a" * 32, b"b" * 32]
    assert not (mover.disk.folder / "cut.tmp").exists()


@pytest.mark.parametrize("kwargs, message", [
    ({"kv_disk_path": "/tmp/x", "kv_disk_size": 1.0}, "--kv-disk-path needs"),
    ({"kv_disk_path": "/tmp/x", "kv_offloading_size": 1.0}, "--kv-disk-path needs"),
    ({"kv_disk_size": 1.0, "kv_offloading_size": 1.0}, "--kv-disk-size needs --kv-disk-path"),
    ({"kv_offloading_size": -1.0}, "--kv-offloading-size"),
    ({"kv_offloading_size": 1.0, "pipeline_parallel_size": 2}, "KV tiers run without pipeline stages"),
    ({"kv_role": "prefill", "pipeline_parallel_size": 2}, "--kv-role prefill with -pp 2"),
])
def test_tier_flags_that_cannot_run_are_refused(kwargs, message):
    from steploop.gpu_worker.config import WorkerConfig

    with pytest.raises(ValueError, match=message):
        WorkerConfig(**kwargs)
