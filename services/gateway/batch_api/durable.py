"""Writes that survive a crash: whole files replaced atomically (temp file, fsync, rename, fsync of the folder),
and append-only journals whose every record is fsynced before the caller moves on. A journal's torn last record
(the process died mid-write) is dropped on read, never misread."""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
from typing import Any


def fsync_dir(folder: pathlib.Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: pathlib.Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json(path: pathlib.Path, value: Any) -> None:
    write_atomic(path, json.dumps(value, separators=(",", ":")).encode())


def read_json(path: pathlib.Path) -> Any:
    return json.loads(path.read_bytes())


class Journal:
    """One JSON record per line, appended and fsynced one at a time (open while a job runs)."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self._file = None

    def append(self, record: dict[str, Any]) -> None:
        if self._file is None:
            self._file = open(self.path, "ab")   # noqa: SIM115 - held open across appends, closed by close()
        self._file.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def records(self) -> list[dict[str, Any]]:
        """Every whole record; a torn tail (no newline, or not JSON) is cut off the file so appends go on after
        the last whole record."""
        if not self.path.exists():
            return []
        raw = self.path.read_bytes()
        out, good = [], 0
        for line in raw.split(b"\n")[:-1]:   # the piece after the last newline is torn (or empty)
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break
            good += len(line) + 1
        if good != len(raw):
            with open(self.path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        return out
