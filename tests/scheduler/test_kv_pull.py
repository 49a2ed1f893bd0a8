"""Cross-replica KV pull in the scheduler, both sides, with no worker: the source (kv_pull_export.py) pins the
blocks it still holds until the plan that sends them is answered, and answers how many went; the receiving side
(kv_pull_import.py) holds the request while it asks, then receives the blocks into host slots in the plan that
admits it, restores them as a prefix, and recomputes whatever did not come. No block is left pinned or held."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
from sched_factories import create_scheduler

from steploop.common.kv_pull import KvPullHint
from steploop.common.pb.steploop.v1 import engine_pb2
from steploop.common.pd_transfer import PdReport
from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import StepResult, WorkerInfo
from steploop.common.tls import TlsConfig
from steploop.scheduler.kv_pull_export import KvPullExport
from steploop.scheduler.kv_pull_import import KvPullImport
from steploop.scheduler.kv_tiers import KvTiers
from steploop.scheduler.prefix_cache import ensure_block_hashes
from steploop.scheduler.request import Request
from tests.span_recorder import recorded_spans

BS = 4
PROMPT = list(range(100, 117))          # 17 tokens: 4 full blocks + 1


def engine(sched) -> SimpleNamespace:
    info = WorkerInfo("w", "m", BS, 40, 1024, 1000, (2,), kv_role="both", kv_block_bytes=100,
                      kv_transfer_address="127.0.0.1:9")
    eng = SimpleNamespace(worker_info=info, scheduler=sched, group=object(), woken=0,
                          server_config=SimpleNamespace(kv_transfer_lease=5.0, tls=TlsConfig()),
                          observer=SimpleNamespace(live={}))
    eng.wake = lambda: setattr(eng, "woken", eng.woken + 1)
    eng.admit_held = sched.add_request
    return eng


def request(rid: str = "a") -> Request:
    return Request(rid, list(PROMPT), sampling=SamplingParams(max_tokens=2, ignore_eos=True))


def cached_source():
    """A scheduler whose pool caches PROMPT's 4 full blocks, none held."""
    sched = create_scheduler(num_blocks=20, block_size=BS)
    r = request("warm")
    sched.kv.allocate_slots(r, len(PROMPT))
    sched.kv.cache_blocks(r, len(PROMPT))
    sched.kv.free(r)
    keys = ensure_block_hashes(r, 4, BS, sched.kv.hasher)[:4]
    return sched, keys


def whole(sched) -> bool:
    sched.kv.check_integrity()
    return sched.kv.num_free_blocks == sched.kv.num_usable_blocks


async def test_the_source_pins_until_its_send_is_answered():
    sched, keys = cached_source()
    export = KvPullExport(engine(sched))
    call = asyncio.create_task(export.export("t1", keys, "10.0.0.2:7000", 5.0))
    await asyncio.sleep(0)
    assert not whole(sched), "the blocks to send are not pinned"
    plan = sched.schedule()
    export.fill_plan(plan)
    assert plan.pd_moves.address == "10.0.0.2:7000"
    assert [s.transfer_id for s in plan.pd_moves.sends] == ["t1"] and len(plan.pd_moves.sends[0].block_ids) == 4
    assert not whole(sched)
    export.on_result(plan, StepResult(plan.step_id, pd_report=PdReport(sent=["t1"])))
    answer = await call
    assert (answer.num_blocks, answer.bytes) == (4, 400) and whole(sched)
    assert (export.exports, export.export_blocks) == (1, 4)


async def test_the_source_answers_none_for_evicted_blocks_failed_sends_and_a_lost_worker():
    sched, keys = cached_source()
    export = KvPullExport(engine(sched))
    gone = await export.export("t0", [b"not-cached", *keys], "10.0.0.2:7000", 5.0)
    assert gone.num_blocks == 0 and "no longer cached" in gone.reason
    call = asyncio.create_task(export.export("t1", keys, "10.0.0.2:7000", 5.0))
    await asyncio.sleep(0)
    plan = sched.schedule()
    export.fill_plan(plan)
    export.on_result(plan, StepResult(plan.step_id, pd_report=PdReport(failed_sends=["t1"])))
    assert (await call).num_blocks == 0 and whole(sched)
    call = asyncio.create_task(export.export("t2", keys, "10.0.0.2:7000", 5.0))
    await asyncio.sleep(0)
    export.fill_plan(sched.schedule())
    export.on_worker_lost()
    assert (await call).num_blocks == 0 and whole(sched) and not export.has_work()


async def test_a_caller_gone_before_the_plan_unpins_at_once():
    sched, keys = cached_source()
    export = KvPullExport(engine(sched))
    call = asyncio.create_task(export.export("t1", keys, "10.0.0.2:7000", 5.0))
    await asyncio.sleep(0)
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    assert whole(sched) and not export.has_work()
    answer = await export.export("t2", keys, "10.0.0.2:7000", 0.01)     # never planned: timed out, unpinned
    assert answer.num_blocks == 0 and "not sent within" in answer.reason and whole(sched)


class FakeSource:
    """A's Engine stub: answers ExportKvBlocks with `blocks` blocks sent, or fails, or never answers."""

    def __init__(self, blocks: int = 0, error: grpc.StatusCode | None = None, hang: bool = False):
        self.blocks, self.error, self.hang, self.asked, self.metadata = blocks, error, hang, [], []

    async def ExportKvBlocks(self, call, timeout, metadata=None):
        self.asked.append(call)
        self.metadata.append(metadata)
        if self.hang:
            await asyncio.Event().wait()
        if self.error is not None:
            raise grpc.aio.AioRpcError(self.error, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")
        return engine_pb2.KvExportReply(num_blocks=self.blocks, bytes=self.blocks * 100)


def receiver(source: FakeSource, host_blocks: int = 8):
    sched = create_scheduler(num_blocks=20, block_size=BS)
    sched.kv.attach_tiers(KvTiers(host_blocks, 0, 100))
    imp = KvPullImport(engine(sched))
    imp._stub = lambda address: source
    return sched, imp


async def ask(imp: KvPullImport, r: Request, blocks: int = 4) -> None:
    assert imp.start(r, KvPullHint("10.0.0.1:50051", blocks))
    await imp.jobs[r.request_id].task


async def test_pulled_blocks_are_received_then_restored_as_the_prefix():
    source = FakeSource(blocks=4)
    sched, imp = receiver(source)
    r = request()
    await ask(imp, r)
    assert source.asked[0].destination == "127.0.0.1:9" and len(source.asked[0].block_hashes) == 4
    imp.admit_ready()
    plan = sched.schedule()
    imp.fill_plan(plan)
    assert len(plan.pd_moves.receives[0].slots) == 4 and not plan.new_requests   # waits for its blocks
    imp.on_result(plan, StepResult(plan.step_id, pd_report=None))
    plan = sched.schedule()
    assert plan.new_requests[0].num_computed_tokens == 16
    assert (imp.stats.pulls, imp.stats.pulled, imp.stats.blocks, imp.stats.failures) == (1, 1, 4, 0)
    sched.kv.check_integrity()


async def test_a_failed_checksum_on_the_worker_recomputes_from_that_block():
    sched, imp = receiver(FakeSource(blocks=4))
    await ask(imp, request())
    imp.admit_ready()
    plan = sched.schedule()
    imp.fill_plan(plan)
    slots = plan.pd_moves.receives[0].slots
    imp.on_result(plan, StepResult(plan.step_id, pd_report=PdReport(failed_recv_slots=[slots[1]])))
    assert sched.schedule().new_requests[0].num_computed_tokens == 4
    assert (imp.stats.pulled, imp.stats.failures) == (0, 1)
    sched.kv.tiers.check()


async def test_a_source_that_is_gone_or_sent_nothing_is_a_recompute():
    for source in (FakeSource(error=grpc.StatusCode.UNAVAILABLE), FakeSource(blocks=0)):
        sched, imp = receiver(source)
        await ask(imp, request())
        imp.admit_ready()
        plan = sched.schedule()
        imp.fill_plan(plan)
        assert plan.new_requests[0].num_computed_tokens == 0 and not plan.pd_moves
        assert imp.stats.failures == 1 and imp.num_held() == 0


async def test_an_abort_while_asking_cancels_the_call_and_discards_what_may_land():
    sched, imp = receiver(FakeSource(hang=True))
    r = request()
    assert imp.start(r, KvPullHint("10.0.0.1:50051", 4))
    await asyncio.sleep(0)
    task = imp.jobs["a"].task
    imp.abort("a")
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled() and imp.num_held() == 0
    imp.admit_ready()
    plan = sched.schedule()
    imp.fill_plan(plan)
    assert plan.pd_moves.discards and not plan.new_requests
    sched.kv.check_integrity()


async def test_blocks_held_here_already_are_not_asked_for_and_a_full_hit_asks_nothing():
    source = FakeSource(blocks=2)
    sched, imp = receiver(source)
    warm = request("warm")
    sched.kv.allocate_slots(warm, 8)
    sched.kv.cache_blocks(warm, 8)                   # blocks 0 and 1 cached in the pool
    await ask(imp, request())
    assert source.asked[0].block_hashes == ensure_block_hashes(request(), 4, BS, sched.kv.hasher)[2:4]
    sched.kv.allocate_slots(warm, 16)
    sched.kv.cache_blocks(warm, 16)
    assert not imp.start(request("b"), KvPullHint("10.0.0.1:50051", 4))


async def test_a_replica_that_cannot_receive_recomputes_and_counts_it():
    sched = create_scheduler(num_blocks=20, block_size=BS)              # no host tier
    imp = KvPullImport(engine(sched))
    assert not imp.start(request(), KvPullHint("10.0.0.1:50051", 4)) and imp.stats.failures == 1


async def test_each_pull_is_a_client_span_under_the_request_whose_trace_rides_to_the_source():
    from steploop.common import tracing

    with recorded_spans() as memory:
        for source in (FakeSource(blocks=4), FakeSource(error=grpc.StatusCode.UNAVAILABLE)):
            sched, imp = receiver(source)
            r = request()
            parent = tracing.tracer().start_span("steploop.scheduler.request")
            imp.engine.observer.live[r.request_id] = SimpleNamespace(span=parent)
            await ask(imp, r)
            parent.end()
            (key, traceparent), = source.metadata[0]
            span = pull_span(memory, parent).get_span_context()
            assert key == "traceparent"
            assert traceparent.split("-")[1:3] == [f"{span.trace_id:032x}", f"{span.span_id:016x}"]
    spans = [s for s in memory.get_finished_spans() if s.name == "steploop.scheduler.kv_pull"]
    assert [(s.attributes["steploop.kv_pull.blocks_asked"], s.attributes["steploop.kv_pull.blocks"],
             s.attributes["steploop.kv_pull.bytes"], s.attributes["steploop.kv_pull.ok"]) for s in spans] == [
        (4, 4, 400, True), (4, 0, 0, False)]
    assert spans[0].attributes["steploop.kv_pull.source"] == "10.0.0.1:50051"
    assert spans[1].attributes["steploop.kv_pull.reason"].startswith("UNAVAILABLE")


def pull_span(memory, parent):
    """the finished pull span whose parent is `parent`"""
    return next(s for s in memory.get_finished_spans()
                if s.name == "steploop.scheduler.kv_pull" and s.parent.span_id == parent.get_span_context().span_id)


async def test_the_source_export_is_a_server_span_in_the_callers_trace():
    from steploop.common import tracing
    from steploop.common.kv_pull import KvExport
    from steploop.scheduler.servicers import EngineServicer

    async def export(transfer_id, keys, destination, lease):
        return KvExport(3, 300) if transfer_id == "t1" else KvExport(0, reason="evicted")

    loop = SimpleNamespace(kv_export=SimpleNamespace(export=export),
                           server_config=SimpleNamespace(kv_transfer_lease=1.0))
    with recorded_spans() as memory:
        caller = tracing.tracer().start_span("steploop.scheduler.kv_pull")
        context = SimpleNamespace(invocation_metadata=lambda: tracing.grpc_metadata(caller))
        replies = [await EngineServicer(loop).ExportKvBlocks(
            engine_pb2.KvExportRequest(transfer_id=t, block_hashes=[b"k"] * 4), context) for t in ("t1", "t2")]
        caller.end()
    assert [(r.num_blocks, r.bytes, r.reason) for r in replies] == [(3, 300, ""), (0, 0, "evicted")]
    spans = [s for s in memory.get_finished_spans() if s.name == "steploop.scheduler.kv_export"]
    assert [s.parent.span_id for s in spans] == [caller.get_span_context().span_id] * 2
    assert [(s.attributes["steploop.kv_pull.blocks_asked"], s.attributes["steploop.kv_pull.blocks"]) for s in spans] \
        == [(4, 3), (4, 0)]
    assert spans[1].attributes["steploop.kv_pull.reason"] == "evicted"


def test_the_source_certificate_is_checked_against_the_configured_name(monkeypatch):
    """Behind a headless Service the gateway hands out pod IPs: --kv-pull-tls-server-name names the certificate's
    host instead (only with TLS; without the flag, the address's own host)."""
    from unittest.mock import MagicMock

    from steploop.scheduler import kv_pull_import

    opened = []
    monkeypatch.setattr(kv_pull_import.tls, "open_channel",
                        lambda address, config, options: opened.append((address, dict(options))) or MagicMock())
    tls_on = TlsConfig(ca="ca.pem", cert="s.pem", key="s.key")
    for config, name in [(tls_on, "engine-headless"), (tls_on, ""), (TlsConfig(), "engine-headless")]:
        sched = create_scheduler(num_blocks=4, block_size=BS)
        imp = KvPullImport(engine(sched))
        imp.engine.server_config = SimpleNamespace(tls=config, kv_pull_tls_server_name=name)
        imp._stub("10.0.0.7:50051")
        imp._stub("10.0.0.7:50051")                     # one channel per source, reused
    assert [(a, o.get("grpc.ssl_target_name_override")) for a, o in opened] == [
        ("10.0.0.7:50051", "engine-headless"), ("10.0.0.7:50051", None), ("10.0.0.7:50051", None)]
