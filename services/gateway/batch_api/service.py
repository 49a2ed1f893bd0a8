"""BatchService: the Batch API's stores and runner over one batch folder (--batch-dir), which one gateway owns at a
time: it holds an exclusive lock on `<batch dir>/.lock` (flock; the kernel drops it when the process dies, even by
SIGKILL). A gateway that finds the folder locked serves the Batch API as 503 naming the folder, and everything
else as usual (point each gateway of a deployment at its own folder)."""

from __future__ import annotations

import fcntl
import logging
import os
import pathlib

from steploop.gateway.batch_api.file_store import FileStore
from steploop.gateway.batch_api.job_store import JobStore
from steploop.gateway.batch_api.runner import BatchRunner
from steploop.gateway.errors import APIError

logger = logging.getLogger(__name__)


class BatchService:
    def __init__(self, root: pathlib.Path, *, max_file_bytes: int, max_lines: int, max_jobs: int, concurrency: int,
                 api_key: str | None) -> None:
        self.root = root
        self.max_jobs = max_jobs
        self._limits = (max_file_bytes, max_lines)
        self._concurrency, self._api_key = concurrency, api_key
        self.files: FileStore | None = None
        self.jobs: JobStore | None = None
        self.runner: BatchRunner | None = None
        self.unavailable = "the Batch API has not started yet"
        self._lock_fd: int | None = None

    def open(self) -> bool:
        """Takes the folder's lock and loads its files and batches; False (and why, in `unavailable`) if another
        gateway holds it or it cannot be made."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as err:
            self.unavailable = f"the batch folder {self.root} cannot be used ({err}); set --batch-dir"
            logger.warning("Batch API off: %s", self.unavailable)
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            self.unavailable = (f"another gateway owns the batch folder {self.root}; give this gateway its own "
                                "--batch-dir")
            logger.warning("Batch API off: %s", self.unavailable)
            return False
        self._lock_fd = fd
        self.files = FileStore(self.root, *self._limits)
        self.jobs = JobStore(self.root)
        self.runner = BatchRunner(self.files, self.jobs, self._concurrency, self._api_key)
        self.unavailable = ""
        return True

    def start(self, base_url: str) -> None:
        """Runs (and resumes) batches through the gateway at base_url (its own listening address)."""
        if self.runner is not None:
            self.runner.start(base_url)

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.stop()
        if self._lock_fd is not None:
            os.close(self._lock_fd)      # releases the lock
            self._lock_fd = None

    def require(self) -> tuple[FileStore, JobStore, BatchRunner]:
        if self.runner is None:
            raise APIError(503, f"the Batch API is not available on this gateway: {self.unavailable}",
                           type="server_error", code="batch_unavailable")
        return self.files, self.jobs, self.runner
