"""KV tiers, one behaviour at a time: demotion instead of drop, restore on a returning prefix, disk promotion
before restore (the request waits for it), a missed file is a recompute, the cost model's say, a lost worker,
the metrics."""

from __future__ import annotations

from sched_factories import Run, create_scheduler, expected_output, step
from tiered_fake_worker import TieredFakeWorker

from steploop.common.kv_moves import KvMoveReport, KvMoves
from steploop.common.sampling_params import SamplingParams
from steploop.scheduler.kv_tier_metrics import kv_tier_families
from steploop.scheduler.kv_tiers import KvTiers, TierStats, restore_is_worth, retire
from steploop.scheduler.request import Request
from steploop.scheduler.stats import EngineLoad

BS = 4


def setup(host: int = 8, disk: int = 0, num_blocks: int = 6, worker: TieredFakeWorker | None = None):
    sched = create_scheduler(num_blocks=num_blocks, block_size=BS, max_num_batched_tokens=64)
    worker = worker or TieredFakeWorker(block_size=BS)
    if host:
        sched.kv.attach_tiers(KvTiers(host, disk, 100, list(worker.disk)))
    return sched, worker


def req(rid: str, prompt: list[int], max_tokens: int = 2) -> Request:
    return Request(rid, prompt, sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def serve(sched, worker, *requests: Request) -> Run:
    run = Run()
    for r in requests:
        sched.add_request(r)
    while sched.has_unfinished_requests():
        step(sched, worker, run)
    for r in requests:
        assert run.tokens[r.request_id] == expected_output(r)[0]
    return run


A = list(range(100, 117))          # 17 tokens: 4 full blocks + 1
B = list(range(200, 217))


def test_a_reused_prefix_block_is_stored_below_not_dropped_and_comes_back():
    sched, worker = setup()
    serve(sched, worker, req("a", A))
    run = serve(sched, worker, req("b", B))              # the pool (6 blocks) reuses a's blocks
    stores = [m for p in run.plans if p.kv_moves for m in p.kv_moves.stores]
    assert len(stores) == 4, stores
    run = serve(sched, worker, req("a2", A))
    first = run.plans[0]
    assert len(first.kv_moves.loads) == 4
    assert first.new_requests[0].num_computed_tokens == 16   # every full block of the prompt but the last token
    assert sched.kv.tiers.stats["CPU"].hits == 16


def test_without_tiers_the_returning_prompt_recomputes():
    sched, worker = setup(host=0)
    serve(sched, worker, req("a", A))
    serve(sched, worker, req("b", B))
    run = serve(sched, worker, req("a2", A))
    assert run.plans[0].new_requests[0].num_computed_tokens == 0


def test_a_disk_prefix_is_promoted_first_and_the_request_waits_for_it():
    sched, worker = setup(host=4, disk=50)
    serve(sched, worker, req("a", A))
    serve(sched, worker, req("b", B))                    # a's 4 blocks to host
    serve(sched, worker, req("c", list(range(300, 317))))  # host full: a's go on to disk
    assert len(worker.disk) >= 4
    sched.add_request(req("a2", A))
    run = Run()
    plan = step(sched, worker, run)
    assert plan.kv_moves.promotes and not plan.scheduled_handles, "promote first, admit when they are in"
    plan = step(sched, worker, run)
    assert plan.kv_moves.loads and plan.new_requests[0].num_computed_tokens == 16
    while sched.has_unfinished_requests():
        step(sched, worker, run)
    assert run.tokens["a2"] == expected_output(req("a2", A))[0]
    assert sched.kv.tiers.stats["DISK"].hits == 16


def test_a_corrupt_file_is_a_miss_and_a_recompute():
    sched, worker = setup(host=4, disk=50)
    serve(sched, worker, req("a", A))
    serve(sched, worker, req("b", B))
    serve(sched, worker, req("c", list(range(300, 317))))
    worker.corrupt.update(worker.disk)                   # every file fails its checksum
    run = serve(sched, worker, req("a2", A))
    admitted = next(p for p in run.plans if p.new_requests)
    assert admitted.new_requests[0].num_computed_tokens == 0
    assert sched.kv.tiers.stats["DISK"].misses >= 4 and not sched.kv.tiers.host.pending


def test_a_restarted_workers_disk_is_indexed_back():
    sched, worker = setup(host=4, disk=50)
    serve(sched, worker, req("a", A))
    serve(sched, worker, req("b", B))
    serve(sched, worker, req("c", list(range(300, 317))))
    sched.preempt_all()                                  # lost; a new worker on the same disk
    assert not sched.kv.tiers.host.entries and not sched.kv.tiers.disk.entries
    worker = TieredFakeWorker(block_size=BS, disk=worker.disk)
    sched.kv.attach_tiers(KvTiers(4, 50, 100, list(worker.disk)))
    run = serve(sched, worker, req("a2", A))
    assert run.plans[0].kv_moves.promotes
    assert next(p for p in run.plans if p.new_requests).new_requests[0].num_computed_tokens == 16


def test_restore_only_when_cheaper_than_recompute():
    cost = (0.0, 1e-3, 0.0)                              # 1 ms per token to recompute
    assert restore_is_worth(1e-4, cost, 2, 16, 32)       # 0.2 ms to copy 2 blocks < 32 ms
    assert not restore_is_worth(0.1, cost, 2, 16, 32)    # 200 ms > 32 ms
    assert restore_is_worth(0.1, None, 2, 16, 32)        # no timings yet: copy


def test_slow_moves_make_the_scheduler_recompute():
    sched = create_scheduler(num_blocks=6, block_size=BS, max_num_batched_tokens=64, max_decode_slowdown=2.0)
    worker = TieredFakeWorker(block_size=BS)
    sched.kv.attach_tiers(KvTiers(8, 0, 100))
    sched.pacer.cost.coefficients = lambda: (0.0, 1e-6, 0.0)   # recomputing is nearly free
    serve(sched, worker, req("a", A))
    serve(sched, worker, req("b", B))
    sched.kv.tiers.seconds_per_block = 1.0               # and copying is slow
    run = serve(sched, worker, req("a2", A))
    assert run.plans[0].new_requests[0].num_computed_tokens == 0 and not run.plans[0].kv_moves.loads


def test_failed_step_without_report_drops_its_promotions():
    tiers = KvTiers(4, 10, 100, [b"k" * 32])
    assert tiers.restore_for("r", [b"k" * 32, b"z" * 32], 0, 2, lambda n: True) is None
    moves = tiers.take_moves()
    tiers.on_result(moves, None, step_failed=True)
    assert not tiers.host.entries and b"k" * 32 not in tiers.disk.entries
    tiers.check()


def test_failed_disk_write_unindexes_the_block():
    tiers = KvTiers(1, 10, 100)
    tiers.demote(1, b"a" * 32)
    tiers.take_moves()
    tiers.demote(2, b"b" * 32)                           # a: host -> disk
    moves = tiers.take_moves()
    assert moves.demotes == [(0, b"a" * 32)]
    tiers.on_result(moves, KvMoveReport(failed_demote_hashes=[b"a" * 32], seconds=0.01))
    assert b"a" * 32 not in tiers.disk.entries and tiers.stats["DISK"].misses == 1
    tiers.check()


def test_metrics_per_medium_and_retired_counters():
    tiers = KvTiers(4, 10, 100)
    tiers.stats["CPU"].hits = 32
    retired: dict[str, TierStats] = {}
    retire(retired, tiers)
    load = EngineLoad(kv_tiers=KvTiers(4, 10, 100).report_load(retired))
    samples = {(f.name, s.labels["medium"]): s.value for f in kv_tier_families(load, ["m"]) for s in f.samples
               if not s.name.endswith("_created")}
    assert samples[("steploop:kv_tier_hits", "CPU")] == 32
    assert samples[("steploop:kv_tier_capacity_blocks", "DISK")] == 10
    assert list(kv_tier_families(EngineLoad(), ["m"])) == []


def test_moves_round_trip_the_wire():
    from steploop.common.pb.steploop.v1 import worker_pb2
    from steploop.common.step_contract import StepPlan, StepResult

    moves = KvMoves([b"d" * 32], [(1, b"e" * 32)], [(b"f" * 32, 2)], [(3, 4)], [(5, 6)])
    plan = StepPlan(step_id=3, kv_moves=moves)
    assert StepPlan.from_pb(worker_pb2.StepPlan.FromString(plan.to_pb().SerializeToString())).kv_moves == moves
    assert StepPlan.from_pb(StepPlan(step_id=1).to_pb()).kv_moves is None
    result = StepResult(step_id=3, kv_moves=KvMoveReport([2], [b"e" * 32], 0.5))
    assert StepResult.from_pb(result.to_pb()).kv_moves == result.kv_moves


def test_kv_events_carry_the_medium_and_the_router_counts_any_tier():
    from steploop.common.block_hashing import block_hashes, hash_block
    from steploop.common.pb.steploop.v1 import engine_pb2
    from steploop.gateway.routing.kv_index import ReplicaCacheIndex
    from steploop.scheduler.kv_events.events import BlockRemoved, BlockStored, KvEventBatch
    from steploop.scheduler.kv_events.recorder import KvEventRecorder

    sched, worker = setup(host=4, disk=50)
    recorder = KvEventRecorder()
    sched.kv.events = sched.kv.pool.events = recorder
    sched.kv.tiers.attach_events(recorder, BS)
    serve(sched, worker, req("a", A))
    serve(sched, worker, req("b", B))
    serve(sched, worker, req("c", list(range(300, 317))))
    events = recorder.take()
    media = {(type(e).__name__, e.medium) for e in events}
    assert {("BlockStored", "GPU"), ("BlockRemoved", "GPU"), ("BlockStored", "CPU"), ("BlockRemoved", "CPU"),
            ("BlockStored", "DISK")} <= media, media
    assert all(e.medium == "GPU" or not e.token_ids for e in events if isinstance(e, BlockStored))
    assert all(len({type(e), e.medium}) == 2 for e in events if isinstance(e, BlockRemoved))

    index = ReplicaCacheIndex(block_size=BS, hasher=hash_block, synced=True)
    index.apply(engine_pb2.KvEventMessage(batch=KvEventBatch(0, 0.0, events).to_pb()))
    a_keys = block_hashes(A, BS, None, hash_block)
    assert not set(a_keys) & index.keys, "a's blocks left the pool"
    assert index.matched_tokens(A, "", {}) == 16, "but they are on disk: a hit for the router"


def _resumes(sched, worker) -> tuple[list[tuple[int, int]], int]:
    """Two requests that outgrow a pool of ~1.5 sequences: (num_computed_tokens, num_tokens) of each resume of a
    preempted request, and the prompt-chunk tokens the run computed again."""
    a, b = req("a", A[:12], max_tokens=12), req("b", B[:12], max_tokens=12)
    run = serve(sched, worker, a, b)
    resumes = [(new.num_computed_tokens, len(new.prompt_token_ids) + len(new.output_token_ids))
               for p in run.plans for new in p.new_requests if new.output_token_ids]
    return resumes, sum(p.total_num_scheduled_tokens for p in run.plans)


def test_preemption_swaps_every_full_block_and_recomputes_only_the_partial_one():
    # 9 blocks of 4 (8 usable): a and b (24 tokens = 6 blocks each) cannot both finish, so one is preempted and
    # the other's growth reuses its tail blocks. With tiers those are demoted and restored on resume: everything
    # up to the last full block comes back; without, the reused blocks are computed again.
    swapped, computed_on = _resumes(*setup(host=16, num_blocks=9))
    amnesic, computed_off = _resumes(*setup(host=0, num_blocks=9))
    assert swapped and amnesic, "the load must preempt"
    for num_computed, num_tokens in swapped:
        assert num_computed == (num_tokens - 1) // BS * BS, swapped
    assert any(num_computed < (num_tokens - 1) // BS * BS for num_computed, num_tokens in amnesic), amnesic
    assert computed_on < computed_off
