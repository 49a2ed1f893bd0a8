"""JobStore: the batches of /v1/batches on disk, and the journal that makes a restart resume without running a line
twice:

    <batch dir>/batches/<id>.json      OpenAI's batch object, replaced atomically at every status change
    <batch dir>/batches/<id>.journal   one record per input line answered, {"line": i, "kind": "output"|"error",
                                       "record": {...}}, fsynced before the next line's answer is taken

Every batch is loaded at start and kept in memory (request_counts move there as lines finish; the object on disk
has them as of its last status change, and a restart recounts them from the journal).

    validating -> in_progress -> finalizing -> completed          (failed: the input file did not validate)
                       └──────> cancelling -> cancelled           (expired: past completion_window)
"""

from __future__ import annotations

import pathlib
import secrets
import time
from typing import Any

from steploop.gateway.batch_api import durable
from steploop.gateway.batch_api.durable import Journal
from steploop.gateway.errors import APIError

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")   # a runner still has work on these
WINDOW_SECONDS = {"24h": 24 * 3600}


def batch_not_found(batch_id: str) -> APIError:
    return APIError(404, f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found")


def new_batch(input_file_id: str, endpoint: str, window: str, metadata: dict | None, total: int) -> dict[str, Any]:
    now = int(time.time())
    return {"id": f"batch_{secrets.token_hex(12)}", "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_file_id, "completion_window": window, "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
            "expires_at": now + WINDOW_SECONDS[window], "finalizing_at": None, "completed_at": None,
            "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": total, "completed": 0, "failed": 0}, "metadata": metadata}


class JobStore:
    def __init__(self, root: pathlib.Path) -> None:
        self.dir = root / "batches"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.batches: dict[str, dict[str, Any]] = {}
        for path in self.dir.glob("batch_*.json"):
            batch = durable.read_json(path)
            self.batches[batch["id"]] = batch

    def get(self, batch_id: str) -> dict[str, Any]:
        batch = self.batches.get(batch_id)
        if batch is None:
            raise batch_not_found(batch_id)
        return batch

    def list(self) -> list[dict[str, Any]]:
        """Newest first (OpenAI's order)."""
        return sorted(self.batches.values(), key=lambda b: (b["created_at"], b["id"]), reverse=True)

    def active(self) -> list[dict[str, Any]]:
        """Batches with work left, oldest first (the order they run in)."""
        return sorted((b for b in self.batches.values() if b["status"] in ACTIVE),
                      key=lambda b: (b["created_at"], b["id"]))

    def add(self, batch: dict[str, Any]) -> None:
        self.batches[batch["id"]] = batch
        self.save(batch)

    def save(self, batch: dict[str, Any]) -> None:
        durable.write_json(self.dir / f"{batch['id']}.json", batch)

    def set_status(self, batch: dict[str, Any], status: str) -> None:
        """A transition, stamped with its time (`<status>_at`) and written before anything acts on it."""
        batch["status"] = status
        stamp = {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
                 "failed": "failed_at", "expired": "expired_at", "cancelling": "cancelling_at",
                 "cancelled": "cancelled_at"}.get(status)
        if stamp is not None:
            batch[stamp] = int(time.time())
        self.save(batch)

    def journal(self, batch_id: str) -> Journal:
        return Journal(self.dir / f"{batch_id}.journal")
