"""The Batch API's storage: durable journals (a torn tail is cut, never misread), the file store's limits and ids,
batches reloaded from disk, the input-file validation, and the folder lock (one gateway per batch folder)."""

from __future__ import annotations

import json

import pytest

from steploop.gateway.batch_api import protocol
from steploop.gateway.batch_api.durable import Journal
from steploop.gateway.batch_api.file_store import FileStore
from steploop.gateway.batch_api.job_store import JobStore, new_batch
from steploop.gateway.batch_api.service import BatchService
from steploop.gateway.errors import APIError


async def _chunks(*parts: bytes):
    for part in parts:
        yield part


def test_journal_appends_and_cuts_a_torn_tail(tmp_path):
    journal = Journal(tmp_path / "j")
    for i in range(3):
        journal.append({"line": i, "kind": "output"})
    journal.close()
    with open(tmp_path / "j", "ab") as f:
        f.write(b'{"line": 3, "ki')          # the process died mid-write
    assert [r["line"] for r in journal.records()] == [0, 1, 2]
    journal.append({"line": 3, "kind": "error"})   # appends go on after the last whole record
    journal.close()
    assert [r["line"] for r in Journal(tmp_path / "j").records()] == [0, 1, 2, 3]


async def test_file_store_streams_checks_limits_and_ids(tmp_path):
    files = FileStore(tmp_path, max_bytes=64, max_lines=3)
    obj = await files.upload(_chunks(b'{"a": 1}\n', b'{"b": 2}\n'), "in.jsonl", "batch")
    assert (obj["object"], obj["bytes"], obj["purpose"], obj["filename"]) == ("file", 18, "batch", "in.jsonl")
    assert files.get(obj["id"]) == obj and files.content_path(obj["id"]).read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    with pytest.raises(APIError) as err:
        await files.upload(_chunks(b"x" * 40, b"y" * 40), "big.jsonl", "batch")
    assert err.value.status == 413
    with pytest.raises(APIError) as err:
        await files.upload(_chunks(b"{}\n" * 4), "long.jsonl", "batch")
    assert err.value.code == "too_many_lines"
    assert [f["id"] for f in files.list()] == [obj["id"]]           # refused uploads leave nothing behind
    assert not [p for p in files.dir.iterdir() if p.name.startswith(".")]
    for bad in ("../../etc/passwd", "file-xyz", "file-"):
        with pytest.raises(APIError) as err:
            files.get(bad)
        assert err.value.status == 404
    files.delete(obj["id"])
    assert files.list() == [] and not files.content_path(obj["id"]).exists()


def test_batches_survive_a_reload(tmp_path):
    jobs = JobStore(tmp_path)
    batch = new_batch("file-ab", "/v1/completions", "24h", {"run": "7"}, total=3)
    jobs.add(batch)
    jobs.set_status(batch, "in_progress")
    again = JobStore(tmp_path)
    got = again.get(batch["id"])
    assert got["status"] == "in_progress" and got["in_progress_at"] and got["metadata"] == {"run": "7"}
    assert [b["id"] for b in again.active()] == [batch["id"]]
    again.set_status(got, "completed")
    assert JobStore(tmp_path).active() == []


def test_input_lines_are_validated_as_openai_describes(tmp_path):
    good = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in (good, {**good, "custom_id": "b"})) + "\n\n")
    lines, errors = protocol.read_lines(path, "/v1/completions")
    assert errors == [] and [(ln.index, ln.custom_id) for ln in lines] == [(0, "a"), (1, "b")]
    path.write_text("\n".join([json.dumps(good), "not json", json.dumps(good),
                               json.dumps({**good, "custom_id": "c", "url": "/v1/chat/completions"}),
                               json.dumps({**good, "custom_id": "d", "body": "x"})]))
    _, errors = protocol.read_lines(path, "/v1/completions")
    assert [(e["line"], e["code"]) for e in errors] == [(2, "invalid_json_line"), (3, "duplicate_custom_id"),
                                                       (4, "mismatched_url"), (5, "invalid_request")]
    path.write_text("\n")
    assert protocol.read_lines(path, "/v1/completions")[1][0]["code"] == "empty_file"


async def test_one_gateway_owns_a_batch_folder(tmp_path):
    limits = dict(max_file_bytes=10, max_lines=10, max_jobs=1, concurrency=1, api_key=None)
    first, second = BatchService(tmp_path, **limits), BatchService(tmp_path, **limits)
    assert first.open() and not second.open()
    with pytest.raises(APIError) as err:
        second.require()
    assert err.value.status == 503 and "another gateway owns" in err.value.message
    await first.close()
    assert second.open()             # released: the next gateway takes it
    await second.close()
