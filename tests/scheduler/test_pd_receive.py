"""The decode side of a prefill/decode transfer in the scheduler's KV tiers: host slots reserved for a transfer's
blocks keep the request waiting until the receiving plan's result; received blocks are then restored as a host
prefix, a receive that failed (a checksum) is a recompute, and the accounting stays whole."""

from __future__ import annotations

from sched_factories import create_scheduler

from steploop.common.sampling_params import SamplingParams
from steploop.scheduler.kv_tiers import KvTiers
from steploop.scheduler.prefix_cache import ensure_block_hashes
from steploop.scheduler.request import Request

BS = 4
PROMPT = list(range(100, 117))          # 17 tokens: 4 full blocks + 1


def reserved(num_host: int = 8):
    sched = create_scheduler(num_blocks=12, block_size=BS, max_num_batched_tokens=64)
    sched.kv.attach_tiers(KvTiers(num_host, 0, 100))
    request = Request("a", list(PROMPT), sampling=SamplingParams(max_tokens=2, ignore_eos=True))
    hashes = ensure_block_hashes(request, 4, BS, sched.kv.hasher)[:4]
    indexes, slots = sched.kv.tiers.reserve_receive("a", hashes)
    sched.kv.tiers.take_moves()           # the receiving plan is built (pins end)
    sched.add_request(request)
    return sched, hashes, indexes, slots


def test_the_request_waits_for_its_receive_then_restores_the_blocks():
    sched, hashes, indexes, slots = reserved()
    assert indexes == [0, 1, 2, 3] and len(set(slots)) == 4
    assert not sched.schedule().new_requests, "admitted before its blocks were received"
    assert sched.kv.tiers.on_receive(list(zip(hashes, slots)), set()) == 0
    plan = sched.schedule()
    assert plan.new_requests[0].num_computed_tokens == 16
    assert sorted(s for s, _ in plan.kv_moves.loads) == sorted(slots)
    sched.kv.tiers.check()


def test_a_failed_receive_is_a_recompute_from_the_failed_block_on():
    sched, hashes, _, slots = reserved()
    assert sched.kv.tiers.on_receive(list(zip(hashes, slots)), {slots[2]}) == 1
    plan = sched.schedule()
    assert plan.new_requests[0].num_computed_tokens == 8       # blocks 0 and 1; 2 failed, so 3 cannot follow
    assert hashes[2] not in sched.kv.tiers.host.entries
    sched.kv.tiers.check()


def test_no_free_host_slot_reserves_fewer_blocks():
    sched, hashes, indexes, slots = reserved(num_host=2)
    assert indexes == [0, 1]
    sched.kv.tiers.on_receive(list(zip(hashes, slots)), set())
    assert sched.schedule().new_requests[0].num_computed_tokens == 8
    sched.kv.tiers.check()
