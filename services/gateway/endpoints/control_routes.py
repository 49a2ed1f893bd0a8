"""Engine control for training loops (vLLM's and SGLang's RL routes), behind the admin key (admin_auth.py) and
registered only when --admin-api-key is set. Each acts on every scheduler replica the gateway routes to.

    POST /pause?mode=abort|wait|keep   abort: live requests end (finish_reason "abort"); wait: they run to their
                                       end first (the call returns then); keep: running ones are preempted and
                                       recomputed on resume, the prefix cache is cleared. New requests wait at the
                                       gateway (--paused-request-timeout) and in the scheduler until /resume.
    POST /resume                       -> {"paused": false}
    GET  /is_paused                    -> {"is_paused": bool}
    POST /update_weights_from_disk     {"model_path": folder, "weight_version": optional str}: every worker rank
                                       loads it between steps (all ranks or none), the prefix cache is cleared;
                                       -> {"success", "message", "weight_version"}; a checkpoint of another shape
                                       is a 400 and the old weights keep serving
    GET  /get_weight_version           -> {"weight_version": str}
    POST /sleep?level=1|2              pause as keep, then every worker rank frees its KV cache (1) and its weights
                                       too (2); -> {"sleep_level", "worker_rss_bytes": [per rank]}
    POST /wake_up                      allocate again (reload the weights after level 2), then resume
    GET  /is_sleeping                  -> {"is_sleeping": bool}
    POST /init_weights_update_group    {master_address, master_port, rank_offset, world_size, group_name, backend}:
                                       every worker rank joins the trainer's gloo group (steploop.weight_sync)
    POST /update_weights_from_distributed   {buckets: [{tensors: [{name, dtype, shape}], sha256}], weight_version}:
                                       every rank receives the broadcast buckets, checks each sha256, then the
                                       update goes as from disk (all ranks or none)

Generation responses carry `x-steploop-weight-version` once the gateway knows the served version (after an update
or a /get_weight_version through it).
"""

from __future__ import annotations

import logging

from aiohttp import web

from steploop.common.engine_control import PAUSE_MODES, ControlState, ReplicaControl
from steploop.gateway.app_keys import PAUSE_GATE, SERVING
from steploop.gateway.errors import APIError, bad_request
from steploop.gateway.http_io import validation as v
from steploop.gateway.http_io.request_body import read_json

logger = logging.getLogger(__name__)
WEIGHT_VERSION_HEADER = "x-steploop-weight-version"


def _state_body(state: ControlState) -> dict:
    body = {"paused": state.paused, "weight_version": state.weight_version, "num_aborted": state.num_aborted,
            "num_preempted": state.num_preempted, "sleep_level": state.sleep_level,
            "worker_rss_bytes": list(state.worker_rss_bytes)}
    if state.replicas:                   # several scheduler replicas (routing/control_fanout.py): each one's own
        body["replicas"] = [_replica_body(r) for r in state.replicas]
    return body


def _replicas(state: ControlState) -> dict:
    return {"replicas": [_replica_body(r) for r in state.replicas]} if state.replicas else {}


def _replica_body(replica: ReplicaControl) -> dict:
    s = replica.state
    return {"address": replica.address, "error": replica.error or None, "fenced": replica.fenced or None,
            "paused": s.paused if s else None, "weight_version": s.weight_version if s else None,
            "sleep_level": s.sleep_level if s else None}


async def pause(request: web.Request) -> web.Response:
    mode = request.query.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise bad_request(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", param="mode")
    gate = request.app[PAUSE_GATE]
    gate.close()                       # new requests wait from now on, while the engine aborts/drains/preempts
    try:
        state = await request.app[SERVING].engine.pause(mode)
    except APIError:
        gate.open()                    # the engine did not pause: do not hold requests for nothing
        raise
    logger.info("engine paused (mode %s): %d aborted, %d preempted", mode, state.num_aborted, state.num_preempted)
    return web.json_response({**_state_body(state), "mode": mode})


async def resume(request: web.Request) -> web.Response:
    state = await request.app[SERVING].engine.resume()
    request.app[PAUSE_GATE].open()
    logger.info("engine resumed")
    return web.json_response(_state_body(state))


async def is_paused(request: web.Request) -> web.Response:
    state = await request.app[SERVING].engine.control_state()
    return web.json_response({"is_paused": state.paused, **_replicas(state)})


async def update_weights_from_disk(request: web.Request) -> web.Response:
    body = v.require_object(await read_json(request))
    path = v.get_str(body, "model_path")
    if not path:
        raise bad_request("'model_path' (a checkpoint folder the workers can read) is required", param="model_path",
                          code="missing_required_parameter")
    version = v.get_str(body, "weight_version") or ""
    serving = request.app[SERVING]
    state = await serving.engine.update_weights_from_disk(path, version)
    serving.model.weight_version = state.weight_version
    logger.info("weights updated from %s: version %s (%d running requests preempted)", path, state.weight_version,
                state.num_preempted)
    return web.json_response({"success": True, "message": f"weights loaded from {path}",
                              **_state_body(state)})


async def get_weight_version(request: web.Request) -> web.Response:
    serving = request.app[SERVING]
    state = await serving.engine.control_state()
    serving.model.weight_version = state.weight_version
    return web.json_response({"weight_version": state.weight_version, **_replicas(state)})


async def init_weights_update_group(request: web.Request) -> web.Response:
    body = v.require_object(await read_json(request))
    group = {"master_address": v.get_str(body, "master_address") or "",
             "master_port": v.get_int(body, "master_port", 0, lo=1, hi=65535),
             "rank_offset": v.get_int(body, "rank_offset", 1, lo=1, hi=65535),
             "world_size": v.get_int(body, "world_size", 0, lo=2, hi=65536),
             "group_name": v.get_str(body, "group_name") or "steploop-weights",
             "backend": v.get_str(body, "backend") or "gloo",
             "timeout_s": float(v.get_number(body, "timeout_s", 60.0, lo=1.0, hi=3600.0))}
    for name in ("master_address", "master_port", "world_size"):
        if not group[name]:
            raise bad_request(f"'{name}' is required", param=name, code="missing_required_parameter")
    if group["backend"] != "gloo":
        raise bad_request(f"backend must be 'gloo' (the CPU collective), got {group['backend']!r}", param="backend")
    await request.app[SERVING].engine.init_weights_update_group(group)
    return web.json_response({"success": True, "message": "joined the weight-update group"})


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    body = v.require_object(await read_json(request))
    buckets = body.get("buckets")
    if not isinstance(buckets, list) or not buckets or not all(
            isinstance(b, dict) and isinstance(b.get("sha256"), str) and isinstance(b.get("tensors"), list) and all(
                isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("dtype"), str)
                and isinstance(t.get("shape"), list) and all(isinstance(d, int) and d >= 0 for d in t["shape"])
                for t in b["tensors"]) for b in buckets):
        raise bad_request("'buckets' must be a list of {tensors: [{name, dtype, shape}], sha256}", param="buckets")
    serving = request.app[SERVING]
    state = await serving.engine.update_weights_from_distributed(
        buckets, v.get_str(body, "weight_version") or "", v.get_str(body, "group_name") or "")
    serving.model.weight_version = state.weight_version
    return web.json_response({"success": True, "message": "weights received", **_state_body(state)})


async def sleep(request: web.Request) -> web.Response:
    level = request.query.get("level", "1")
    if level not in ("1", "2"):
        raise bad_request(f"level must be 1 or 2, got {level!r}", param="level")
    gate = request.app[PAUSE_GATE]
    gate.close()
    try:
        state = await request.app[SERVING].engine.sleep(int(level))
    except APIError:
        if not (await request.app[SERVING].engine.control_state()).paused:
            gate.open()
        raise
    logger.info("engine asleep (level %s): worker RSS %s", level, list(state.worker_rss_bytes))
    return web.json_response(_state_body(state))


async def wake_up(request: web.Request) -> web.Response:
    state = await request.app[SERVING].engine.wake_up()
    request.app[PAUSE_GATE].open()
    logger.info("engine awake: worker RSS %s", list(state.worker_rss_bytes))
    return web.json_response(_state_body(state))


async def is_sleeping(request: web.Request) -> web.Response:
    state = await request.app[SERVING].engine.control_state()
    return web.json_response({"is_sleeping": state.sleep_level > 0, **_replicas(state)})


async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """Generation responses say which weights served them (as far as this gateway knows)."""
    version = request.app[SERVING].model.weight_version
    if version is not None and request.path.startswith("/v1/"):
        response.headers[WEIGHT_VERSION_HEADER] = version


def add_routes(app: web.Application, enabled: bool) -> None:
    if not enabled:
        return
    app.router.add_post("/pause", pause)
    app.router.add_post("/resume", resume)
    app.router.add_get("/is_paused", is_paused)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_get("/get_weight_version", get_weight_version)
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/init_weights_update_group", init_weights_update_group)
    app.router.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_get("/is_sleeping", is_sleeping)
    app.on_response_prepare.append(on_prepare)
