"""The gateway's KvEventWatcher over real gRPC: a stream that breaks while the scheduler lives on (a network
blip) resumes from (instance_id, next sequence). The batches missed meanwhile are replayed, no snapshot is
sent, and the index counts as in sync again at once, even when nothing was missed (the scheduler's initial
metadata says it resumed). Before, a resumed index stayed "not synced" until the next snapshot, so routing
fell back to guessing for good after one blip."""

from __future__ import annotations

import asyncio
import types

import grpc

from steploop.common import grpc_options
from steploop.common.pb.steploop.v1 import engine_pb2_grpc
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.routing.kv_index import KvEventWatcher, ReplicaCacheIndex
from steploop.scheduler.servicers import EngineServicer
from tests.integration.cluster import free_port
from tests.kv_events.helpers import expected_chain, make_hub, run_prompt


async def _serve(hub, port: int) -> grpc.aio.Server:
    server = grpc.aio.server(options=grpc_options.SERVER)
    engine_pb2_grpc.add_EngineServicer_to_server(EngineServicer(types.SimpleNamespace(kv_events=hub)), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


async def _until(condition, what: str, index: ReplicaCacheIndex, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"never: {what} ({index})"
        await asyncio.sleep(0.02)    # a poll interval


async def test_a_broken_stream_resumes_with_the_missed_batches_and_is_in_sync_again():
    hub, kv = make_hub(num_blocks=32, block_size=4)
    snapshots = []
    watch = hub.watch

    def counting_watch(from_sequence, instance_id):
        snapshots.append(not hub.resumes(instance_id, from_sequence))
        return watch(from_sequence, instance_id)
    hub.watch = counting_watch
    first, missed = list(range(1000, 1008)), list(range(2000, 2008))
    run_prompt(kv, "first", first)
    port = free_port()
    server = await _serve(hub, port)
    client = EngineClient(f"127.0.0.1:{port}")
    index = ReplicaCacheIndex()
    watcher = KvEventWatcher(client, index)
    watcher.start()
    try:
        await _until(lambda: index.synced and set(expected_chain(first, 4)) <= index.keys, "the first snapshot", index)
        await server.stop(grace=0)                      # the link breaks; the scheduler (the hub) lives on
        await _until(lambda: not index.synced, "the watcher noticing the broken stream", index)
        run_prompt(kv, "missed", missed)
        hub.flush()                                      # a batch nobody is watching
        server = await _serve(hub, port)
        await _until(lambda: index.synced and set(expected_chain(missed, 4)) <= index.keys, "the replayed batch", index)
        assert snapshots == [True, False] and index.next_sequence == hub.next_sequence

        await server.stop(grace=0)                      # again, and this time nothing happens meanwhile
        await _until(lambda: not index.synced, "the second break", index)
        server = await _serve(hub, port)
        await _until(lambda: index.synced, "in sync again with nothing to replay", index)
        assert snapshots == [True, False, False]
        assert set(expected_chain(first, 4) + expected_chain(missed, 4)) <= index.keys
    finally:
        await watcher.stop()
        await client.close()
        await server.stop(grace=0)
