"""Server reflection on the scheduler: a client with no protos in hand (grpcio-reflection's own client, as grpcurl,
grpcui and Postman do it) lists Engine and Health, resolves GenerateRequest and calls Generate and GetModelInfo
with messages built from the reflected descriptors, in plaintext and over mutual TLS. The README's grpcurl
payloads are parsed against the reflected descriptors, so a renamed field fails here."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
import re
import shlex

import grpc
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from steploop.common.tls import TlsConfig
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.server import SchedulerService
from steploop.scheduler.server_config import ServerConfig
from tests.integration.certs import make_certs
from tests.scheduler_service.fake_grpc_worker import FakeGrpcWorker
from tests.scheduler_service.test_engine_service import expected

pytestmark = pytest.mark.asyncio
README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
TIMEOUT = 10.0


async def off_loop(fn, *args):
    """The reflection client is synchronous and its pool asks the server lazily: run it off the event loop that
    serves the scheduler, with a deadline."""
    return await asyncio.wait_for(asyncio.to_thread(fn, *args), 3 * TIMEOUT)


def reflect(channel: grpc.Channel) -> tuple[set[str], descriptor_pool.DescriptorPool]:
    database = ProtoReflectionDescriptorDatabase(channel)
    return set(database.get_services()), descriptor_pool.DescriptorPool(database)


def field_names(pool: descriptor_pool.DescriptorPool, message: str) -> set[str]:
    return set(pool.FindMessageTypeByName(message).fields_by_name)


def call(channel: grpc.Channel, pool: descriptor_pool.DescriptorPool, method_name: str, body: dict) -> list[dict]:
    """One Engine call with request and answers built from reflected descriptors only (what grpcurl does)."""
    method = pool.FindServiceByName("steploop.v1.Engine").methods_by_name[method_name]
    request_cls = message_factory.GetMessageClass(method.input_type)
    response_cls = message_factory.GetMessageClass(method.output_type)
    request = json_format.ParseDict(body, request_cls())        # unknown field names raise
    path = f"/steploop.v1.Engine/{method_name}"
    kind = channel.unary_stream if method.server_streaming else channel.unary_unary
    rpc = kind(path, request_serializer=request_cls.SerializeToString, response_deserializer=response_cls.FromString)
    answers = rpc(request, timeout=TIMEOUT)
    return [json_format.MessageToDict(a, preserving_proto_field_name=True)
            for a in (answers if method.server_streaming else [answers])]


def readme_grpcurl_calls() -> list[tuple[str, dict]]:
    """(method, -d payload) of every grpcurl call in the README that sends one."""
    text = README.read_text()
    calls = []
    for command in re.findall(r"^grpcurl .*?(?<!\\)$", text, flags=re.MULTILINE | re.DOTALL):
        words = shlex.split(command.replace("\\\n", " "))
        if "-d" in words:
            calls.append((words[-1].rsplit("/", 1)[-1], json.loads(words[words.index("-d") + 1])))
    return calls


async def test_reflection_lists_engine_and_health_and_a_reflected_client_generates(service):
    worker = FakeGrpcWorker(service.address)
    worker.info = dataclasses.replace(worker.info, vocab_size=49152)    # the README's ids are the default model's
    worker.start()
    try:
        with grpc.insecure_channel(service.address) as channel:
            services, pool = await off_loop(reflect, channel)
            assert {"steploop.v1.Engine", "grpc.health.v1.Health"} <= services
            assert "steploop.v1.PlanStream" not in services               # internal: workers ship its stubs
            assert {"prompt_token_ids", "sampling", "request_id"} <= await off_loop(
                field_names, pool, "steploop.v1.GenerateRequest")
            chunks = await off_loop(call, channel, pool, "Generate", {
                "prompt_token_ids": [11, 12, 13], "sampling": {"max_tokens": 5, "ignore_eos": True}})
            assert [t for c in chunks for t in c.get("token_ids", [])] == expected([11, 12, 13], 5)
            assert chunks[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
            assert chunks[-1]["usage"]["completion_tokens"] == 5
            [info] = await off_loop(call, channel, pool, "GetModelInfo", {})
            assert (info["model_name"], info["num_workers"]) == ("fake-model", 1)
            readme_calls = readme_grpcurl_calls()
            assert {"Generate", "GetModelInfo"} <= {method for method, _ in readme_calls}
            for method, body in readme_calls:
                answers = await off_loop(call, channel, pool, method, body)
                assert answers and "error_message" not in answers[-1]
    finally:
        await worker.kill()


async def test_reflection_over_mutual_tls_and_strangers_are_refused(tmp_path):
    certs = make_certs(tmp_path)
    server_tls = TlsConfig(cert=str(certs["server"]), key=str(certs["server.key"]), ca=str(certs["ca"]))
    svc = await SchedulerService(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8),
                                 ServerConfig(host="127.0.0.1", port=0, tls=server_tls, shutdown_timeout=1.0)).start()
    address = f"127.0.0.1:{svc.port}"
    client = TlsConfig(cert=str(certs["client"]), key=str(certs["client.key"]), ca=str(certs["ca"]))
    stranger = TlsConfig(ca=str(certs["ca"]))                           # trusts the server, has no certificate
    try:
        with grpc.secure_channel(address, client.channel_credentials()) as channel:
            services, pool = await off_loop(reflect, channel)
            assert {"steploop.v1.Engine", "grpc.health.v1.Health"} <= services
            [info] = await off_loop(call, channel, pool, "GetModelInfo", {})
            assert info.get("num_workers", 0) == 0                      # no worker attached: an empty ModelInfo
        with grpc.secure_channel(address, stranger.channel_credentials()) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                await off_loop(reflect, channel)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE   # the handshake fails: no reflection
    finally:
        await svc.stop()
