"""What /v1/batches accepts: the create body, and the input file's lines as OpenAI's Batch API defines them,

    {"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

every line's url the batch's endpoint, custom_ids unique. A file that does not validate fails the batch with one
error per bad line (OpenAI's `errors` list), before any line runs."""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Any

from steploop.gateway.batch_api.job_store import WINDOW_SECONDS
from steploop.gateway.errors import bad_request
from steploop.gateway.http_io import validation as v

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_ERRORS = 100        # errors listed for a file that fails validation (the first ones)


@dataclass(frozen=True)
class CreateRequest:
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None


@dataclass(frozen=True)
class Line:
    index: int                  # 0-based line number in the input file
    custom_id: str
    body: dict[str, Any]


def parse_create(body: Any) -> CreateRequest:
    body = v.require_object(body)
    file_id = v.get_str(body, "input_file_id")
    if not file_id:
        raise bad_request("'input_file_id' is required", param="input_file_id", code="missing_required_parameter")
    endpoint = v.get_str(body, "endpoint")
    if endpoint not in ENDPOINTS:
        raise bad_request(f"'endpoint' must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", param="endpoint")
    window = v.get_str(body, "completion_window") or "24h"
    if window not in WINDOW_SECONDS:
        raise bad_request(f"'completion_window' must be one of {', '.join(WINDOW_SECONDS)}, got {window!r}",
                          param="completion_window")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or not all(
            isinstance(k, str) and isinstance(val, str) and len(k) <= 64 and len(val) <= 512
            for k, val in metadata.items())):
        raise bad_request("'metadata' must be an object of at most 16 string pairs (keys up to 64 characters, "
                          "values up to 512)", param="metadata")
    return CreateRequest(file_id, endpoint, window, metadata)


def read_lines(path: pathlib.Path, endpoint: str) -> tuple[list[Line], list[dict[str, Any]]]:
    """(the lines, the errors): a file with any error runs no line."""
    lines: list[Line] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    with open(path, "rb") as f:
        for index, raw in enumerate(f):
            if not raw.strip():
                continue
            line, error = _parse_line(index, raw, endpoint, seen)
            if error is not None:
                errors.append({"code": error[0], "message": error[1], "param": error[2], "line": index + 1})
            else:
                lines.append(line)
    if not lines and not errors:
        errors.append({"code": "empty_file", "message": "the input file has no request line", "param": None,
                       "line": None})
    return lines, errors[:MAX_ERRORS]


def _parse_line(index: int, raw: bytes, endpoint: str, seen: set[str]):
    try:
        item = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return None, ("invalid_json_line", f"line {index + 1} is not valid JSON: {err}", None)
    if not isinstance(item, dict):
        return None, ("invalid_request", f"line {index + 1} is not a JSON object", None)
    custom_id, body = item.get("custom_id"), item.get("body")
    if not isinstance(custom_id, str) or not custom_id:
        return None, ("missing_required_parameter", f"line {index + 1} has no custom_id", "custom_id")
    if custom_id in seen:
        return None, ("duplicate_custom_id", f"custom_id {custom_id!r} appears more than once", "custom_id")
    seen.add(custom_id)
    if item.get("method", "POST") != "POST":
        return None, ("invalid_request", f"line {index + 1}: method must be POST", "method")
    if item.get("url") != endpoint:
        return None, ("mismatched_url", f"line {index + 1}: url {item.get('url')!r} is not the batch's endpoint {endpoint}",
                      "url")
    if not isinstance(body, dict):
        return None, ("invalid_request", f"line {index + 1}: body must be a JSON object", "body")
    return Line(index, custom_id, body), None
