"""FileStore: the files of /v1/files on disk, one folder:

    <batch dir>/files/<id>.jsonl     the content, as uploaded (or written: a batch's output and error files)
    <batch dir>/files/<id>.json      OpenAI's file object {id, object, bytes, created_at, filename, purpose, status}

Uploads stream to a temp file (never held in memory) and are checked while they arrive: at most max_bytes, and for
purpose "batch" UTF-8 JSON lines, at most max_lines of them. The object is written last, so a file whose object
exists is whole.
"""

from __future__ import annotations

import os
import pathlib
import secrets
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

from steploop.gateway.batch_api import durable
from steploop.gateway.errors import APIError, bad_request

PURPOSES = ("batch", "batch_output")      # what this server stores (uploads: "batch")


def file_not_found(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id}", param="file_id", code="file_not_found")


class FileStore:
    def __init__(self, root: pathlib.Path, max_bytes: int, max_lines: int) -> None:
        self.dir = root / "files"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.max_lines = max_bytes, max_lines

    def content_path(self, file_id: str) -> pathlib.Path:
        return self.dir / f"{file_id}.jsonl"

    def get(self, file_id: str) -> dict[str, Any]:
        path = self.dir / f"{file_id}.json"
        if not _valid_id(file_id, "file-") or not path.is_file():
            raise file_not_found(file_id)
        return durable.read_json(path)

    def list(self, purpose: str | None = None) -> list[dict[str, Any]]:
        files = [durable.read_json(p) for p in self.dir.glob("file-*.json")]
        return sorted((f for f in files if purpose is None or f["purpose"] == purpose),
                      key=lambda f: (f["created_at"], f["id"]), reverse=True)

    def delete(self, file_id: str) -> None:
        self.get(file_id)
        (self.dir / f"{file_id}.json").unlink()
        self.content_path(file_id).unlink(missing_ok=True)

    async def upload(self, chunks: AsyncIterator[bytes], filename: str, purpose: str) -> dict[str, Any]:
        """Streams an upload to disk, checking its limits as it arrives; returns the file object."""
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".upload-")
        size, lines = 0, 0
        try:
            with os.fdopen(fd, "wb") as f:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise APIError(413, f"the file is over {self.max_bytes} bytes (--batch-max-file-bytes)",
                                       param="file", code="file_too_large")
                    lines += chunk.count(b"\n")
                    if purpose == "batch" and lines > self.max_lines:
                        raise bad_request(f"the file has over {self.max_lines} lines (--batch-max-lines)",
                                          param="file", code="too_many_lines")
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            if size == 0:
                raise bad_request("the file is empty", param="file", code="empty_file")
            return self._commit(pathlib.Path(tmp), filename, purpose, size)
        finally:
            pathlib.Path(tmp).unlink(missing_ok=True)

    def write(self, data: bytes, filename: str, purpose: str) -> dict[str, Any]:
        """A file this server made (a batch's output or errors)."""
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".write-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            return self._commit(pathlib.Path(tmp), filename, purpose, len(data))
        finally:
            pathlib.Path(tmp).unlink(missing_ok=True)

    def _commit(self, tmp: pathlib.Path, filename: str, purpose: str, size: int) -> dict[str, Any]:
        file_id = f"file-{secrets.token_hex(12)}"
        os.replace(tmp, self.content_path(file_id))
        obj = {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()), "filename": filename,
               "purpose": purpose, "status": "processed", "expires_at": None, "status_details": None}
        durable.write_json(self.dir / f"{file_id}.json", obj)
        return obj


def _valid_id(value: str, prefix: str) -> bool:
    """Ids are ours (prefix + hex): anything else (a path, '..') never reaches the filesystem."""
    rest = value[len(prefix):]
    return value.startswith(prefix) and 0 < len(rest) <= 64 and all(c in "0123456789abcdef" for c in rest)
