"""The engine control routes (control_routes.py) in the gateway's OpenAPI document: present only when the gateway
runs with --admin-api-key, and each needs that key (the `admin` security scheme; the user key gets 403)."""

from __future__ import annotations

from typing import Any

from steploop.common.engine_control import PAUSE_MODES

_REPLICA = {"type": "object", "properties": {
    "address": {"type": "string"}, "error": {"type": ["string", "null"]}, "fenced": {"type": ["string", "null"]},
    "paused": {"type": ["boolean", "null"]}, "weight_version": {"type": ["string", "null"]},
    "sleep_level": {"type": ["integer", "null"]}}}
_REPLICAS = {"type": "array", "items": _REPLICA,
             "description": "each scheduler replica's own answer (only in front of several)"}
STATE = {"type": "object", "required": ["paused", "weight_version"], "properties": {
    "paused": {"type": "boolean"}, "weight_version": {"type": "string"}, "num_aborted": {"type": "integer"},
    "num_preempted": {"type": "integer"}, "sleep_level": {"type": "integer", "minimum": 0, "maximum": 2},
    "worker_rss_bytes": {"type": "array", "items": {"type": "integer"}}, "replicas": _REPLICAS}}
_UPDATED = {"type": "object", "required": ["success", "weight_version"], "properties": {
    **STATE["properties"], "success": {"type": "boolean"}, "message": {"type": "string"}}}
_FROM_DISK = {"type": "object", "required": ["model_path"], "properties": {
    "model_path": {"type": "string", "minLength": 1,
                   "description": "a checkpoint folder of the served architecture that every worker can read"},
    "weight_version": {"type": "string"}}}
_GROUP = {"type": "object", "required": ["master_address", "master_port", "world_size"], "properties": {
    "master_address": {"type": "string", "minLength": 1}, "master_port": {"type": "integer", "minimum": 1,
                                                                          "maximum": 65535},
    "rank_offset": {"type": "integer", "minimum": 1, "maximum": 65535, "default": 1},
    "world_size": {"type": "integer", "minimum": 2, "maximum": 65536},
    "group_name": {"type": "string"}, "backend": {"type": "string", "enum": ["gloo"]},
    "timeout_s": {"type": "number", "minimum": 1, "maximum": 3600, "default": 60}}}
_TENSOR = {"type": "object", "required": ["name", "dtype", "shape"], "properties": {
    "name": {"type": "string"}, "dtype": {"type": "string", "enum": ["float32", "bfloat16", "float16"]},
    "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}
_FROM_DISTRIBUTED = {"type": "object", "required": ["buckets"], "properties": {
    "buckets": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["tensors", "sha256"], "properties": {
            "tensors": {"type": "array", "items": _TENSOR}, "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"}}}},
    "weight_version": {"type": "string"}, "group_name": {"type": "string"}}}


def paths(json_body, responses) -> dict[str, Any]:
    admin = [{"admin": []}]

    def op(op_id: str, ok: dict, description: str, **extra) -> dict:
        return {"operationId": op_id, "security": admin, "description": description,
                "responses": responses(ok), **extra}

    def query(name: str, values: list[str], default: str) -> list[dict]:
        return [{"name": name, "in": "query", "required": False,
                 "schema": {"type": "string", "enum": values, "default": default}}]

    def flag(name: str) -> dict:
        return {"type": "object", "required": [name], "properties": {name: {"type": "boolean"}, "replicas": _REPLICAS}}

    return {
        "/pause": {"post": op("pause", STATE, "abort: live requests end; wait: they finish first; keep: they are "
                              "preempted and recomputed on resume. Every scheduler replica pauses, or none.",
                              parameters=query("mode", list(PAUSE_MODES), "abort"))},
        "/resume": {"post": op("resume", STATE, "held requests run; a replica that cannot resume is fenced")},
        "/is_paused": {"get": op("isPaused", flag("is_paused"), "whether the engine is paused")},
        "/sleep": {"post": op("sleep", STATE, "pause (keep) and free each worker's KV cache (1) and weights (2)",
                              parameters=query("level", ["1", "2"], "1"))},
        "/wake_up": {"post": op("wakeUp", STATE, "allocate again (reload weights after level 2), then resume")},
        "/is_sleeping": {"get": op("isSleeping", flag("is_sleeping"), "whether the workers are asleep")},
        "/update_weights_from_disk": {"post": op(
            "updateWeightsFromDisk", _UPDATED, "every replica stages the checkpoint, then all switch (or none)",
            requestBody=json_body(_FROM_DISK))},
        "/get_weight_version": {"get": op("getWeightVersion", {"type": "object", "required": ["weight_version"],
                                                               "properties": {"weight_version": {"type": "string"},
                                                                              "replicas": _REPLICAS}},
                                          "the served weights' version (comma-separated when replicas differ)")},
        "/init_weights_update_group": {"post": op(
            "initWeightsUpdateGroup", {"type": "object", "properties": {"success": {"type": "boolean"},
                                                                        "message": {"type": "string"}}},
            "every worker rank joins the trainer's gloo group (steploop.weight_sync)",
            requestBody=json_body(_GROUP))},
        "/update_weights_from_distributed": {"post": op(
            "updateWeightsFromDistributed", _UPDATED, "buckets broadcast by the trainer, sha256 checked per bucket; "
            "every replica stages them, then all switch (or none)", requestBody=json_body(_FROM_DISTRIBUTED))},
    }
