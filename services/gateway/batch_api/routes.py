"""The Batch API's handlers, as the openai SDK calls them:

    POST   /v1/files                      multipart: file (JSONL) + purpose "batch"   client.files.create
    GET    /v1/files[?purpose=]           client.files.list
    GET    /v1/files/{file_id}            client.files.retrieve
    GET    /v1/files/{file_id}/content    client.files.content (inputs, outputs, errors)
    DELETE /v1/files/{file_id}            client.files.delete
    POST   /v1/batches                    {input_file_id, endpoint, completion_window, metadata}
    GET    /v1/batches[?limit=&after=]    client.batches.list (newest first)
    GET    /v1/batches/{batch_id}         client.batches.retrieve
    POST   /v1/batches/{batch_id}/cancel  client.batches.cancel
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from steploop.gateway.app_keys import BATCHES
from steploop.gateway.batch_api import protocol
from steploop.gateway.batch_api.job_store import new_batch
from steploop.gateway.errors import APIError, bad_request
from steploop.gateway.http_io.request_body import read_json

CHUNK_BYTES = 1 << 16


async def create_file(request: web.Request) -> web.Response:
    files, _, _ = request.app[BATCHES].require()
    if not request.content_type.startswith("multipart/"):
        raise bad_request("upload the file as multipart/form-data with fields 'file' and 'purpose'", param="file")
    purpose, obj = await _read_upload(request, files)
    if obj is not None and purpose != "batch":
        files.delete(obj["id"])
    if purpose is None:
        raise bad_request("'purpose' is required", param="purpose", code="missing_required_parameter")
    if purpose != "batch":
        raise bad_request(f"'purpose' must be 'batch' (this server stores batch inputs only), got {purpose!r}",
                          param="purpose")
    if obj is None:
        raise bad_request("'file' is required", param="file", code="missing_required_parameter")
    return web.json_response(obj)


async def _read_upload(request: web.Request, files) -> tuple[str | None, dict | None]:
    """(purpose, the stored file object) from the multipart body; a malformed body is a 400 (nothing kept)."""
    purpose, obj = None, None
    try:
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if part.name == "purpose":
                purpose = (await part.text()).strip()
            elif part.name == "file" and obj is None:
                obj = await files.upload(_chunks(part), part.filename or "upload.jsonl", "batch")
            else:
                await part.release()
    except (HttpProcessingError, ValueError, UnicodeDecodeError) as err:   # bad part headers, boundary, charset
        if obj is not None:
            files.delete(obj["id"])
        raise bad_request(f"malformed multipart/form-data body: {err}", param="file") from None
    return purpose, obj


async def _chunks(part):
    while chunk := await part.read_chunk(CHUNK_BYTES):
        yield chunk


async def list_files(request: web.Request) -> web.Response:
    files, _, _ = request.app[BATCHES].require()
    data = files.list(request.query.get("purpose"))
    return web.json_response({"object": "list", "data": data, "has_more": False,
                              "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None})


async def get_file(request: web.Request) -> web.Response:
    files, _, _ = request.app[BATCHES].require()
    return web.json_response(files.get(request.match_info["file_id"]))


async def file_content(request: web.Request) -> web.StreamResponse:
    files, _, _ = request.app[BATCHES].require()
    file_id = request.match_info["file_id"]
    files.get(file_id)
    return web.FileResponse(files.content_path(file_id), headers={"Content-Type": "application/jsonl"})


async def delete_file(request: web.Request) -> web.Response:
    files, jobs, _ = request.app[BATCHES].require()
    file_id = request.match_info["file_id"]
    files.get(file_id)
    if any(b["input_file_id"] == file_id for b in jobs.active()):
        raise APIError(409, f"file {file_id} is the input of a batch that is still running; cancel it first",
                       param="file_id", code="file_in_use")
    files.delete(file_id)
    return web.json_response({"id": file_id, "object": "file", "deleted": True})


async def create_batch(request: web.Request) -> web.Response:
    service = request.app[BATCHES]
    files, jobs, runner = service.require()
    req = protocol.parse_create(await read_json(request))
    file = files.get(req.input_file_id)
    if file["purpose"] != "batch":
        raise bad_request(f"file {req.input_file_id} has purpose {file['purpose']!r}; a batch's input needs "
                          "purpose 'batch'", param="input_file_id")
    if len(jobs.active()) >= service.max_jobs:
        raise APIError(429, f"{service.max_jobs} batches are already queued or running (--batch-max-jobs); retry "
                       "once one ends", type="server_error", code="batch_limit_exceeded", headers={"Retry-After": "60"})
    lines, errors = await asyncio.to_thread(protocol.read_lines, files.content_path(req.input_file_id), req.endpoint)
    batch = new_batch(req.input_file_id, req.endpoint, req.completion_window, req.metadata, len(lines))
    if errors:
        batch["errors"] = {"object": "list", "data": errors}
        batch["request_counts"]["total"] = 0
        batch["status"] = "failed"
        batch["failed_at"] = batch["created_at"]
    jobs.add(batch)
    runner.wake()
    return web.json_response(batch)


async def list_batches(request: web.Request) -> web.Response:
    _, jobs, _ = request.app[BATCHES].require()
    try:
        limit = int(request.query.get("limit", "20"))
    except ValueError:
        raise bad_request("'limit' must be an integer in 1..100", param="limit") from None
    if not 1 <= limit <= 100:
        raise bad_request("'limit' must be an integer in 1..100", param="limit")
    batches = jobs.list()
    after = request.query.get("after")
    if after:
        ids = [b["id"] for b in batches]
        batches = batches[ids.index(after) + 1:] if after in ids else []
    page = batches[:limit]
    return web.json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None, "has_more": len(batches) > limit})


async def get_batch(request: web.Request) -> web.Response:
    _, jobs, _ = request.app[BATCHES].require()
    return web.json_response(jobs.get(request.match_info["batch_id"]))


async def cancel_batch(request: web.Request) -> web.Response:
    _, jobs, runner = request.app[BATCHES].require()
    batch = jobs.get(request.match_info["batch_id"])
    if batch["status"] in ("validating", "in_progress"):
        runner.cancel(batch)
    elif batch["status"] not in ("cancelling", "cancelled"):
        raise APIError(409, f"Cannot cancel a batch with status {batch['status']}.", param="batch_id",
                       code="batch_not_cancellable")
    return web.json_response(batch)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/files", create_file)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", get_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_delete("/v1/files/{file_id}", delete_file)
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", get_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)
