"""/v1/files and /v1/batches in the gateway's OpenAPI document (bounds as protocol.py and the stores check)."""

from __future__ import annotations

from typing import Any

from steploop.gateway.batch_api.protocol import ENDPOINTS, WINDOW_SECONDS

_FILE = {"type": "object", "required": ["id", "object", "bytes", "created_at", "filename", "purpose"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string", "enum": ["file"]}, "bytes": {"type": "integer"},
    "created_at": {"type": "integer"}, "filename": {"type": "string"}, "purpose": {"type": "string"}}}
_COUNTS = {"type": "object", "properties": {"total": {"type": "integer"}, "completed": {"type": "integer"},
                                            "failed": {"type": "integer"}}}
_BATCH = {"type": "object", "required": ["id", "object", "endpoint", "input_file_id", "status"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string", "enum": ["batch"]}, "endpoint": {"type": "string"},
    "input_file_id": {"type": "string"}, "completion_window": {"type": "string"},
    "status": {"type": "string", "enum": ["validating", "in_progress", "finalizing", "completed", "failed",
                                          "expired", "cancelling", "cancelled"]},
    "output_file_id": {"type": ["string", "null"]}, "error_file_id": {"type": ["string", "null"]},
    "request_counts": _COUNTS, "metadata": {"type": ["object", "null"]}, "errors": {"type": ["object", "null"]}}}
_METADATA = {"type": ["object", "null"], "maxProperties": 16, "propertyNames": {"maxLength": 64},
             "additionalProperties": {"type": "string", "maxLength": 512}}
CREATE_BATCH = {"type": "object", "required": ["input_file_id", "endpoint", "completion_window"], "properties": {
    "input_file_id": {"type": "string", "minLength": 1}, "endpoint": {"type": "string", "enum": list(ENDPOINTS)},
    "completion_window": {"type": "string", "enum": list(WINDOW_SECONDS)}, "metadata": _METADATA}}
_UPLOAD = {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"], "properties": {
        "file": {"type": "string", "format": "binary",
                 "description": "JSONL: one {custom_id, method: POST, url, body} per line"},
        "purpose": {"type": "string", "enum": ["batch"]}}}}}}


def _list(item: dict) -> dict:
    return {"type": "object", "required": ["object", "data"], "properties": {
        "object": {"type": "string", "enum": ["list"]}, "data": {"type": "array", "items": item},
        "has_more": {"type": "boolean"}, "first_id": {"type": ["string", "null"]},
        "last_id": {"type": ["string", "null"]}}}


def paths(json_body, responses) -> dict[str, Any]:
    security = [{"bearer": []}, {}]
    file_id = [{"name": "file_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    batch_id = [{"name": "batch_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    deleted = {"type": "object", "required": ["id", "deleted"],
               "properties": {"id": {"type": "string"}, "object": {"type": "string"}, "deleted": {"type": "boolean"}}}
    return {
        "/v1/files": {
            "post": {"operationId": "createFile", "security": security, "requestBody": _UPLOAD,
                     "description": "A Batch API input file (limits: --batch-max-file-bytes, --batch-max-lines).",
                     "responses": responses(_FILE)},
            "get": {"operationId": "listFiles", "security": security,
                    "parameters": [{"name": "purpose", "in": "query", "required": False,
                                    "schema": {"type": "string"}}],
                    "responses": responses(_list(_FILE))}},
        "/v1/files/{file_id}": {
            "get": {"operationId": "retrieveFile", "security": security, "parameters": file_id,
                    "responses": responses(_FILE)},
            "delete": {"operationId": "deleteFile", "security": security, "parameters": file_id,
                       "responses": responses(deleted)}},
        "/v1/files/{file_id}/content": {"get": {
            "operationId": "downloadFile", "security": security, "parameters": file_id,
            "responses": {**responses({"type": "string"}),
                          "200": {"description": "the file's JSONL", "content": {
                              "application/jsonl": {"schema": {"type": "string"}}}}}}},
        "/v1/batches": {
            "post": {"operationId": "createBatch", "security": security, "requestBody": json_body(CREATE_BATCH),
                     "description": "Runs every line of the input file as background work (below interactive "
                                    "requests under every scheduling policy); at most --batch-max-jobs at once.",
                     "responses": responses(_BATCH)},
            "get": {"operationId": "listBatches", "security": security, "parameters": [
                {"name": "limit", "in": "query", "required": False,
                 "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
                {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}}],
                "responses": responses(_list(_BATCH))}},
        "/v1/batches/{batch_id}": {"get": {"operationId": "retrieveBatch", "security": security,
                                           "parameters": batch_id, "responses": responses(_BATCH)}},
        "/v1/batches/{batch_id}/cancel": {"post": {"operationId": "cancelBatch", "security": security,
                                                   "parameters": batch_id, "responses": responses(_BATCH)}},
    }
