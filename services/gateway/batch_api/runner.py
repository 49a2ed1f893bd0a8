"""BatchRunner: runs the batches of a JobStore, oldest first, one at a time, each line a request to this gateway's
own endpoint over loopback HTTP (so a line is validated, tokenized, routed and answered exactly as the same request
from a client), at most `concurrency` lines at once, as background work: the `x-steploop-batch-id` header makes
the gateway mark its engine requests background (request_class.py), so under every scheduling policy interactive
requests are admitted first, take the step budget before batch prompt chunks, and batch requests are preempted
first; they also carry the lowest `priority` (2**31-1), ordering them within the background class.

Exactly once: a line's answer is appended to the batch's journal (fsynced) as it arrives, and only lines with no
answer there are sent, once each in a process. After a crash (SIGKILL) the next start resumes every active batch
from its journal; lines that were in flight then had no recorded answer, so they run again and are answered once.
A line answered 503 (engine paused, overloaded, restarting, the gateway draining) is not an answer: it is retried
after a backoff, and on a shutdown it is left for the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from typing import Any

import aiohttp

from steploop.gateway.batch_api import protocol
from steploop.gateway.batch_api.file_store import FileStore
from steploop.gateway.batch_api.job_store import JobStore
from steploop.gateway.batch_api.protocol import Line

logger = logging.getLogger(__name__)

BATCH_PRIORITY = 2**31 - 1        # the lowest the API takes (lower runs first)
RETRY_STATUSES = (429, 502, 503, 504)
BACKOFF_S = (0.5, 10.0)


class BatchRunner:
    def __init__(self, files: FileStore, jobs: JobStore, concurrency: int, api_key: str | None) -> None:
        self.files, self.jobs, self.concurrency = files, jobs, concurrency
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = ""
        self.current: str | None = None          # the batch running now
        self._wakeup = asyncio.Event()
        self._cancel = asyncio.Event()           # the running batch was cancelled
        self._task: asyncio.Task | None = None
        self.lines_sent = 0                      # since start (tests, logs)

    def start(self, base_url: str) -> None:
        self.base_url = base_url
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Ends the runner now: lines in flight are abandoned unrecorded (the next start runs them)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def wake(self) -> None:
        self._wakeup.set()

    def cancel(self, batch: dict[str, Any]) -> None:
        """Cancels a batch: a running one stops taking lines (in-flight ones are aborted) and the runner finalizes
        it; a queued one is finalized now."""
        self.jobs.set_status(batch, "cancelling")
        if batch["id"] == self.current:
            self._cancel.set()
        else:
            self._finalize(batch, "cancelled")

    # ---- the loop ----------------------------------------------------------------------------------------------
    async def _run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            while True:
                active = self.jobs.active()
                if not active:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                batch = active[0]
                self.current = batch["id"]
                self._cancel.clear()
                try:
                    await self._run_batch(session, batch)
                except asyncio.CancelledError:
                    raise
                except Exception:     # a broken batch must not stop the others
                    logger.exception("batch %s failed", batch["id"])
                    batch["errors"] = {"object": "list", "data": [{"code": "internal_error", "message":
                                       "the batch failed on the server; see the gateway logs", "param": None,
                                       "line": None}]}
                    self.jobs.set_status(batch, "failed")
                finally:
                    self.current = None

    async def _run_batch(self, session: aiohttp.ClientSession, batch: dict[str, Any]) -> None:
        if batch["status"] == "validating":
            self.jobs.set_status(batch, "in_progress")
        if batch["status"] == "in_progress":
            lines, _ = await asyncio.to_thread(protocol.read_lines, self.files.content_path(batch["input_file_id"]),
                                               batch["endpoint"])
            ended = await self._run_lines(session, batch, lines)
            if ended == "done":
                self.jobs.set_status(batch, "finalizing")
            elif ended == "expired":
                self._finalize(batch, "expired")
                return
        if batch["status"] == "finalizing":
            self._finalize(batch, "completed")
        elif batch["status"] == "cancelling":
            self._finalize(batch, "cancelled")

    async def _run_lines(self, session: aiohttp.ClientSession, batch: dict[str, Any], lines: list[Line]) -> str:
        """Sends every line the journal has no answer for; returns "done", "cancelled" or "expired"."""
        journal = self.jobs.journal(batch["id"])
        answered = await asyncio.to_thread(journal.records)
        done = {r["line"] for r in answered}
        counts = batch["request_counts"]
        counts["completed"] = sum(r["kind"] == "output" for r in answered)
        counts["failed"] = len(answered) - counts["completed"]
        todo = [line for line in lines if line.index not in done]
        logger.info("batch %s: %d of %d lines to run%s", batch["id"], len(todo), len(lines),
                    f" (resumed: {len(done)} answered before)" if done else "")
        write = asyncio.Lock()
        slots = asyncio.Semaphore(self.concurrency)
        finished = 0

        async def run(line: Line) -> None:
            nonlocal finished
            try:
                kind, record = await self._answer(session, batch, line)
                async with write:
                    await asyncio.to_thread(journal.append, {"line": line.index, "kind": kind, "record": record})
                counts["completed" if kind == "output" else "failed"] += 1
                finished += 1
            finally:
                slots.release()

        tasks: set[asyncio.Task] = set()
        started: list[asyncio.Task] = []
        try:
            for line in todo:
                await slots.acquire()
                if self._cancel.is_set() or time.time() > batch["expires_at"]:
                    slots.release()
                    break
                task = asyncio.ensure_future(run(line))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                started.append(task)
                self.lines_sent += 1
            while tasks and not self._cancel.is_set():
                cancelled = asyncio.ensure_future(self._cancel.wait())
                await asyncio.wait([*tasks, cancelled], return_when=asyncio.FIRST_COMPLETED)
                cancelled.cancel()
        finally:
            for task in list(tasks):     # cancelled, or the runner stops: their answers are not recorded
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            journal.close()
        failures = [t.exception() for t in started if not t.cancelled() and t.exception() is not None]
        if failures:                      # a line that could not be recorded (disk full...) fails the batch
            raise failures[0]
        if self._cancel.is_set():
            return "cancelled"
        return "done" if finished == len(todo) else "expired"

    async def _answer(self, session: aiohttp.ClientSession, batch: dict[str, Any], line: Line) -> tuple[str, dict]:
        """The line's answer as ("output" | "error", OpenAI's batch output record); retries 503s until it gets one."""
        body = {**line.body, "stream": False}
        if batch["endpoint"] != "/v1/embeddings":
            body["priority"] = BATCH_PRIORITY
        headers = {**self.headers, "x-steploop-batch-id": batch["id"]}
        delay = BACKOFF_S[0]
        while True:
            try:
                async with session.post(self.base_url + batch["endpoint"], json=body, headers=headers) as resp:
                    status, payload = resp.status, await resp.json(content_type=None)
            except (aiohttp.ClientError, ValueError) as err:
                status, payload = 0, {"error": {"message": str(err)}}
            if status and status not in RETRY_STATUSES:
                break
            logger.debug("batch %s line %d: %s; retrying in %.1f s", batch["id"], line.index, status or payload,
                         delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_S[1])
        record = {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": line.custom_id,
                  "response": {"status_code": status, "request_id": payload.get("id", "") if isinstance(
                      payload, dict) else "", "body": payload}, "error": None}
        if status == 200:
            return "output", record
        error = payload.get("error", {}) if isinstance(payload, dict) else {}
        record["error"] = {"code": error.get("code") or str(status), "message": error.get("message", "")}
        return "error", record

    # ---- the end -----------------------------------------------------------------------------------------------
    def _finalize(self, batch: dict[str, Any], status: str) -> None:
        """Writes the output and error files from the journal (in input order) and ends the batch with `status`."""
        answered = sorted(self.jobs.journal(batch["id"]).records(), key=lambda r: r["line"])
        for kind, key in (("output", "output_file_id"), ("error", "error_file_id")):
            records = [r["record"] for r in answered if r["kind"] == kind]
            if records and batch[key] is None:
                data = b"".join(_json_line(r) for r in records)
                batch[key] = self.files.write(data, f"{batch['id']}_{kind}.jsonl", "batch_output")["id"]
        counts = batch["request_counts"]
        counts["completed"] = sum(r["kind"] == "output" for r in answered)
        counts["failed"] = len(answered) - counts["completed"]
        self.jobs.set_status(batch, status)
        logger.info("batch %s %s: %d completed, %d failed of %d", batch["id"], status, counts["completed"],
                    counts["failed"], counts["total"])


def _json_line(record: dict[str, Any]) -> bytes:
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
