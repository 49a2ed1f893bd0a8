"""The scheduler's side of prefill/decode disaggregation (pd_disagg.py), driven step by step with a fake prefill
worker: which requests go disaggregated, a confirmed transfer hands the request to the decode side with its
blocks, and every failure (a refused send, an abort, a lost prefill group, the lease) frees the prefill side and
recomputes locally, counted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sched_factories import FakeWorker, create_scheduler

from steploop.common.pd_transfer import PdReport
from steploop.common.sampling_params import SamplingParams
from steploop.scheduler.kv_tiers import KvTiers
from steploop.scheduler.pd_disagg import PdDisagg
from steploop.scheduler.request import Request
from tests.span_recorder import recorded_spans

BS = 4


class FakeEngine:
    def __init__(self):
        self.server_config = SimpleNamespace(disagg_policy="cost", disagg_min_prompt_tokens=12, kv_transfer_lease=60.0,
                                             tp_collective_timeout=5.0)
        self.sched_config = None
        self.worker_info = SimpleNamespace(kv_transfer_address="127.0.0.1:9", block_size=BS, model_name="m",
                                           dtype="float32", cache_dtype="float32", kv_block_bytes=100,
                                           transfer_block_bytes=100)
        self.observer = SimpleNamespace(live={})
        self.scheduler = create_scheduler(num_blocks=20, block_size=BS)
        self.scheduler.kv.attach_tiers(KvTiers(8, 0, 100))
        self.control = SimpleNamespace(weight_updates=0)
        self.admitted: list[Request] = []

    def wake(self):
        pass

    def admit_handed_off(self, request):
        self.admitted.append(request)


def setup():
    engine = FakeEngine()
    pd = PdDisagg(engine)
    pd.scheduler = create_scheduler(num_blocks=16, block_size=BS)
    pd.group = SimpleNamespace(is_closed=False, close=lambda reason: None)
    return engine, pd


def req(rid: str, n: int = 17) -> Request:
    return Request(rid, list(range(100, 100 + n)), sampling=SamplingParams(max_tokens=4, ignore_eos=True))


def prefill_step(pd: PdDisagg, worker: FakeWorker, send_ok: bool = True):
    plan = pd.scheduler.schedule()
    pd._add_sends(plan)
    result = worker.execute(plan)
    if plan.pd_moves:
        ids = [s.transfer_id for s in plan.pd_moves.sends]
        result.pd_report = PdReport(sent=ids if send_ok else [], failed_sends=[] if send_ok else ids)
    pd.scheduler.update_from_output(plan, result)
    pd._on_prefill_result(plan, result)
    return plan


def prefill_whole(pd: PdDisagg) -> bool:
    kv = pd.scheduler.kv
    return not pd.scheduler.has_unfinished_requests() and kv.num_free_blocks == kv.num_usable_blocks


def test_the_rule_long_prompts_go_disaggregated_short_and_forced_ones_stay():
    engine, pd = setup()
    assert pd.choose(req("a", 17), "").disaggregate and not pd.choose(req("b", 8), "").disaggregate
    assert pd.choose(req("c", 8), "disaggregated").disaggregate and not pd.choose(req("d", 17), "local").disaggregate
    lora = req("e")
    lora.lora_name = "x"
    assert not pd.choose(lora, "disaggregated").disaggregate
    assert pd.stats.local == 3                     # b, d and the LoRA request: counted as local
    pd.group.is_closed = True                      # the prefill group is down: local
    assert not pd.choose(req("f"), "disaggregated").disaggregate
    assert pd.stats.local == 3                     # no prefill group attached: nothing to count against
    pd.group.is_closed = False
    engine.control.weight_updates = 1              # only the decode group got the new weights
    assert not pd.choose(req("g"), "disaggregated").disaggregate


def test_a_confirmed_transfer_hands_the_request_off_with_its_blocks():
    engine, pd = setup()
    pd.start(req("a"))
    plan = prefill_step(pd, FakeWorker())
    assert [s.transfer_id for s in plan.pd_moves.sends] == ["a"]
    assert len(plan.pd_moves.sends[0].block_ids) == 4        # (17 - 1) // 4 full blocks
    assert prefill_whole(pd) and not pd.jobs
    pd.admit_ready()
    (recv,) = pd._moves.receives
    assert recv.transfer_id == "a" and recv.indexes == [0, 1, 2, 3]
    assert [r.request_id for r in engine.admitted] == ["a"] and pd.stats.fallbacks == 0
    assert pd.stats.transfers == 1


def test_a_prompt_in_chunks_is_sent_once_whole_by_the_plan_that_completes_it():
    _, pd = setup()
    pd.scheduler = create_scheduler(max_num_batched_tokens=16, num_blocks=32, block_size=BS)
    pd.start(req("a", 41))                         # chunks of 16, 16 and 9 tokens
    worker = FakeWorker()
    assert prefill_step(pd, worker).pd_moves is None and prefill_step(pd, worker).pd_moves is None
    plan = prefill_step(pd, worker)
    (send,) = plan.pd_moves.sends
    assert len(send.block_ids) == 10               # (41 - 1) // 4: every full block, computed by now
    assert prefill_whole(pd) and not pd.jobs and pd.stats.transfers == 1


def test_a_refused_send_is_a_counted_local_recompute():
    engine, pd = setup()
    pd.start(req("a"))
    prefill_step(pd, FakeWorker(), send_ok=False)
    pd.admit_ready()
    assert not pd._moves.receives and [r.request_id for r in engine.admitted] == ["a"]
    assert pd.stats.fallbacks == 1 and pd.stats.transfer_failures == 1 and prefill_whole(pd)


def test_an_abort_frees_the_prefill_side_and_discards_a_landed_transfer():
    engine, pd = setup()
    pd.start(req("a", 40))
    assert pd.abort("a") and prefill_whole(pd) and not pd.jobs
    pd.start(req("b"))
    worker = FakeWorker()
    plan = pd.scheduler.schedule()
    pd._add_sends(plan)
    pd.abort("b")                                  # while its send is in flight
    result = worker.execute(plan)
    result.pd_report = PdReport(sent=["b"])
    pd.scheduler.update_from_output(plan, result)
    pd._on_prefill_result(plan, result)
    assert pd.discards == ["b"] and prefill_whole(pd) and not engine.admitted


def test_a_lost_prefill_group_and_an_expired_lease_fall_back():
    engine, pd = setup()
    pd.start(req("a"))
    pd.start(req("b"))
    pd.lose("killed")
    assert sorted(r.request_id for r in engine.admitted) == []      # handed off at the next decode plan
    pd.admit_ready()
    assert sorted(r.request_id for r in engine.admitted) == ["a", "b"] and pd.stats.fallbacks == 2
    engine, pd = setup()
    pd.lease = 0.0
    pd.start(req("c"))
    pd._expire()
    assert prefill_whole(pd) and pd.stats.fallbacks == 1


def test_each_transfer_is_a_span_when_tracing_is_on():
    with recorded_spans() as memory:
        _, pd = setup()
        pd.start(req("a"))
        pd.start(req("b"))
        prefill_step(pd, FakeWorker(), send_ok=True)
    spans = sorted(memory.get_finished_spans(), key=lambda s: s.attributes["steploop.request_id"])
    assert [s.name for s in spans] == ["steploop.scheduler.kv_transfer"] * 2
    assert [(s.attributes["steploop.request_id"], s.attributes["steploop.kv_transfer.blocks"],
             s.attributes["steploop.kv_transfer.bytes"], s.attributes["steploop.kv_transfer.ok"]) for s in spans] == [
        ("a", 4, 400, True), ("b", 4, 400, True)]


def test_a_prompt_the_prefill_pool_cannot_hold_runs_locally():
    engine, pd = setup()
    assert not pd.start(req("a", 100))         # 16 blocks of 4 tokens: no room for 100
    assert not pd.jobs and pd.stats.disaggregated == 0 and prefill_whole(pd)


def test_a_lora_prompt_runs_on_the_prefill_group_with_its_adapter_and_its_blocks_keyed_alike():
    from steploop.scheduler.async_scheduler import make_scheduler
    from steploop.scheduler.config import SchedulerConfig
    from steploop.scheduler.kv_cache_manager import KVCacheManager
    from steploop.scheduler.lora_steps import LoraSteps
    from steploop.scheduler.prefix_cache import ensure_block_hashes

    engine, pd = setup()
    pd.scheduler = make_scheduler(SchedulerConfig(), KVCacheManager(16, BS, True), 1024, [2], lora=LoraSteps(2))
    pd.with_lora = True
    request = Request("a", list(range(100, 140)), sampling=SamplingParams(max_tokens=4, ignore_eos=True),
                      lora_name="sql", lora_path="/adapters/sql")
    assert pd.choose(request, "disaggregated").disaggregate and pd.start(request)
    plan = pd.scheduler.schedule()
    assert [(m.name, m.path) for m in plan.lora_loads] == [("sql", "/adapters/sql")]   # the prefill worker loads it
    prefill = pd.jobs["a"].prefill
    kv = engine.scheduler.kv
    # the prefill side's blocks carry the adapter in their keys as the decode side's do: a hit never crosses adapters
    n = 40 // BS
    assert ensure_block_hashes(prefill, n, BS, kv.hasher)[:n] == ensure_block_hashes(request, n, BS, kv.hasher)[:n]
    base = Request("b", list(range(100, 140)), sampling=SamplingParams(max_tokens=4))
    assert ensure_block_hashes(base, 1, BS, kv.hasher)[0] != ensure_block_hashes(request, 1, BS, kv.hasher)[0]


def test_a_prefill_group_whose_kv_cache_dtype_differs_is_refused():
    """e4m3 blocks handed to a decode group of another cache dtype would be read as other numbers: refused at attach,
    naming both."""
    from steploop.common.errors import InvalidRequestError
    from steploop.common.step_contract import WorkerInfo
    from steploop.scheduler.worker_link import WorkerLink

    pd = PdDisagg(FakeEngine())
    info = WorkerInfo(worker_id="p0", model_name="m", block_size=BS, num_kv_blocks=20, max_model_len=64,
                      vocab_size=10, eos_token_ids=(2,), dtype="float32", kv_cache_dtype="float8_e4m3fn",
                      kv_role="prefill")
    with pytest.raises(InvalidRequestError, match="KV cache float8_e4m3fn\\); the decode group 'm' .*KV cache float32"):
        pd.attach(WorkerLink(object(), info))
    assert pd.group is None
