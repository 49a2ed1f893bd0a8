"""Where a prompt runs (pd_choice.py): the step-cost models of both groups price a local prefill (its time, the
streams it slows) against a disaggregated one (the prefill queue, the transfer at the measured bandwidth, the
hand-off), with the local prefix-cache hit subtracted; forced either way by the request's field; local whenever
the prefill group is down. The models here are fitted from synthetic GPU-like step timings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sched_factories import FakeWorker, create_scheduler

from steploop.common.pd_transfer import PdReport
from steploop.common.sampling_params import SamplingParams
from steploop.scheduler.kv_tiers import KvTiers
from steploop.scheduler.pd_choice import PRIOR_BYTES_PER_SECOND, LinkRate, local_hit_tokens
from steploop.scheduler.pd_disagg import PdDisagg
from steploop.scheduler.pd_metrics import pd_families
from steploop.scheduler.request import Request
from steploop.scheduler.step_cost import attention_pairs
from tests.span_recorder import recorded_spans

BS = 16
A, B, C = 0.005, 5e-5, 1e-9                   # step base, per token, per attention pair (seconds)
BLOCK_BYTES = 1 << 20


class FakeEngine:
    def __init__(self, policy: str = "cost"):
        self.server_config = SimpleNamespace(disagg_policy=policy, disagg_min_prompt_tokens=1024,
                                             kv_transfer_lease=60.0, tp_collective_timeout=5.0)
        self.sched_config = None
        self.worker_info = SimpleNamespace(kv_transfer_address="127.0.0.1:9", block_size=BS, model_name="m",
                                           dtype="float32", cache_dtype="float32", kv_block_bytes=BLOCK_BYTES,
                                           transfer_block_bytes=BLOCK_BYTES)
        self.observer = SimpleNamespace(live={})
        self.scheduler = create_scheduler(max_num_batched_tokens=512, num_blocks=2000, block_size=BS,
                                          max_model_len=8192)
        self.scheduler.kv.attach_tiers(KvTiers(64, 0, BLOCK_BYTES))
        self.control = SimpleNamespace(weight_updates=0)

    def wake(self):
        pass

    def admit_handed_off(self, request):
        pass


def fit(sched) -> None:
    """Feed a group's step-cost model steps of several shapes timed as A + B*tokens + C*pairs."""
    for tokens, ctx in [(1, 100), (8, 800), (64, 3000), (512, 512), (256, 2048), (32, 200), (512, 4096), (4, 50),
                        (128, 1000), (300, 300)]:
        pairs = attention_pairs(tokens, ctx) if tokens > 8 else tokens * ctx
        sched.pacer.cost.observe(tokens, pairs, A + B * tokens + C * pairs)


def setup(streams: int = 4, policy: str = "cost", fitted: bool = True):
    engine = FakeEngine(policy)
    pd = PdDisagg(engine)
    pd.scheduler = create_scheduler(max_num_batched_tokens=512, num_blocks=4000, block_size=BS, max_model_len=8192)
    pd.group = SimpleNamespace(is_closed=False, close=lambda reason: None)
    if fitted:
        fit(engine.scheduler)
        fit(pd.scheduler)
    decoding(engine.scheduler, streams)
    return engine, pd


def decoding(sched, n: int) -> None:
    """n requests decoding on the decode group (their prompts done)."""
    for i in range(n):
        sched.add_request(req(f"stream-{i}", 40, seed=i + 1, max_tokens=1000))
    worker = FakeWorker(block_size=BS)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running) or sched.waiting:
        plan = sched.schedule()
        sched.update_from_output(plan, worker.execute(plan))
    assert len(sched.running) == n


def req(rid: str, n: int = 4096, seed: int = 0, max_tokens: int = 8) -> Request:
    return Request(rid, [100 + (seed * 7919 + i) % 40000 for i in range(n)],
                   sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def cache_locally(sched, prompt: Request, num_tokens: int) -> None:
    """The decode pool holds the first num_tokens of the prompt as freed, hashed blocks (a finished request's)."""
    kv = sched.kv
    warm = Request("warm", prompt.prompt_token_ids[:num_tokens + 1], sampling=SamplingParams(max_tokens=1))
    kv.allocate_slots(warm, num_tokens)
    kv.cache_blocks(warm, num_tokens)
    kv.free(warm)


def test_a_long_prompt_with_an_idle_prefill_group_goes_disaggregated():
    _, pd = setup(streams=4)
    choice = pd.choose(req("a"), "")
    assert choice.disaggregate and choice.reason == "cost"
    assert 0 < choice.remote_seconds < choice.local_seconds
    assert pd.stats.decisions == {("disaggregated", "cost"): 1}


def test_nothing_decoding_locally_keeps_even_a_long_prompt_local():
    _, pd = setup(streams=0)                   # no stream to protect: the transfer is pure cost
    choice = pd.choose(req("a"), "")
    assert not choice.disaggregate and choice.reason == "cost"


def test_a_deep_prefill_queue_keeps_a_long_prompt_local():
    _, pd = setup(streams=4)
    for i in range(12):                          # 12 x 4096 prompt tokens already waiting on the prefill group
        assert pd.start(req(f"q{i}", seed=100 + i))
    choice = pd.choose(req("a"), "")
    assert not choice.disaggregate and choice.reason == "cost"
    assert choice.remote_seconds > choice.local_seconds


def test_a_short_prompt_stays_local():
    _, pd = setup(streams=4)
    choice = pd.choose(req("a", 40), "")
    assert not choice.disaggregate and choice.reason == "cost"
    assert pd.choose(req("b", BS), "").reason == "short"      # not one full block to send
    assert pd.stats.local == 2


def test_a_mostly_cached_prompt_stays_local_and_a_cached_one_moves_nothing():
    engine, pd = setup(streams=4)
    prompt = req("a")
    assert pd.choose(prompt, "").disaggregate                  # not cached yet: as above
    cache_locally(engine.scheduler, prompt, 4096 - 6 * BS)
    choice = pd.choose(req("b"), "")
    assert not choice.disaggregate and choice.reason == "cost"
    cache_locally(engine.scheduler, prompt, 4095 // BS * BS)
    assert pd.choose(req("c"), "").reason == "cached"


def test_a_group_that_is_down_means_local_even_when_forced():
    _, pd = setup(streams=4)
    pd.group.is_closed = True
    for mode in ("", "disaggregated"):
        choice = pd.choose(req("a"), mode)
        assert not choice.disaggregate and choice.reason == "down"
    assert pd.stats.local == 0                    # no group up: nothing to count a local prompt against


def test_the_flag_forces_either_way():
    _, pd = setup(streams=4)
    assert pd.choose(req("a"), "local") == pd.choose(req("b"), "local")
    assert not pd.choose(req("a"), "local").disaggregate          # long, idle prefill group: still local
    for i in range(12):
        pd.start(req(f"q{i}", seed=100 + i))
    forced = pd.choose(req("c"), "disaggregated")                  # deep prefill queue: still disaggregated
    assert forced.disaggregate and forced.reason == "forced"
    lora = req("d")
    lora.lora_name = "x"
    assert pd.choose(lora, "disaggregated").reason == "unsupported"     # the prefill workers load no adapters
    pd.with_lora = True                                                  # they run --enable-lora
    assert pd.choose(lora, "disaggregated") == pd.choose(req("e"), "disaggregated")


def test_length_policy_and_a_cold_model_use_the_threshold_on_uncached_tokens():
    _, pd = setup(streams=0, policy="length")
    assert pd.choose(req("a", 1024), "").disaggregate and not pd.choose(req("b", 1000), "").disaggregate
    engine, pd = setup(streams=0, fitted=False)
    choice = pd.choose(req("c", 1024), "")
    assert choice.disaggregate and choice.reason == "threshold"
    cache_locally(engine.scheduler, req("c", 1024), 512)
    assert not pd.choose(req("d", 1024), "").disaggregate         # 512 uncached: under the threshold


def test_the_bandwidth_estimate_follows_confirmed_transfers():
    link = LinkRate()
    assert link.bytes_per_second == pytest.approx(PRIOR_BYTES_PER_SECOND)
    for _ in range(20):
        link.observe(100 << 20, 10.0)            # 10 MiB/s
    assert link.bytes_per_second == pytest.approx(10 * 2**20, rel=0.01)
    link.observe(0, 1.0)
    link.observe(1 << 20, 0.0)                   # nothing measured: ignored
    assert link.num_observations == 20
    _, pd = setup(streams=4)
    assert pd.choose(req("a"), "").disaggregate
    pd.start(req("x", 64))                       # a transfer the prefill worker timed: 64 MB in 6.4 s
    plan = pd.scheduler.schedule()
    pd._add_sends(plan)
    result = FakeWorker(block_size=BS).execute(plan)
    result.pd_report = PdReport(sent=["x"], seconds=6.4, bytes_sent=64_000_000)
    pd.scheduler.update_from_output(plan, result)
    pd._on_prefill_result(plan, result)
    assert pd.chooser.link.num_observations == 1 and pd.chooser.link.bytes_per_second < 1e8
    for _ in range(10):
        pd.chooser.link.observe(64_000_000, 6.4)
    choice = pd.choose(req("b"), "")              # 255 MB at 10 MB/s: 25 s on the wire
    assert not choice.disaggregate and choice.reason == "cost"


def test_decisions_are_a_labelled_counter():
    _, pd = setup(streams=4)
    pd.choose(req("a"), "")
    pd.choose(req("b", 40), "")
    pd.choose(req("c"), "local")
    load = SimpleNamespace(pd=pd.report(), kv_pull=None)
    (family,) = [f for f in pd_families(load, ["m"]) if f.name == "steploop:pd_decisions"]
    got = {(s.labels["choice"], s.labels["reason"]): s.value for s in family.samples if s.name.endswith("_total")}
    assert got == {("disaggregated", "cost"): 1.0, ("local", "cost"): 1.0, ("local", "forced"): 1.0}


def test_the_choice_is_on_the_request_span():
    from steploop.common import tracing

    with recorded_spans() as memory:
        engine, pd = setup(streams=4)
        rec = SimpleNamespace(span=tracing.tracer().start_span("steploop.scheduler.request"))
        engine.observer.live["a"] = rec
        pd.trace_choice("a", pd.choose(req("a"), ""))
        rec.span.end()
    (span,) = memory.get_finished_spans()
    attrs = span.attributes
    assert (attrs["steploop.pd.choice"], attrs["steploop.pd.reason"]) == ("disaggregated", "cost")
    assert 0 < attrs["steploop.pd.disaggregated_seconds"] < attrs["steploop.pd.local_seconds"]


def test_the_local_hit_continues_into_the_host_tier_but_not_into_blocks_still_arriving():
    engine, _ = setup(streams=0)
    kv = engine.scheduler.kv
    prompt = req("a", 64)
    cache_locally(engine.scheduler, prompt, 16)                   # pool: block 0
    assert kv.get_computed_blocks(prompt)[1] == 16                 # (and the prompt's block hashes computed)
    host = kv.tiers.host
    for slot, key in enumerate(prompt.block_hashes[1:3]):          # host: blocks 1 and 2
        host.insert(key, slot)
    assert local_hit_tokens(kv, req("b", 64)) == 48
    host.pending.add(prompt.block_hashes[2])                       # block 2 is being received: not loadable yet
    assert local_hit_tokens(kv, req("c", 64)) == 32
