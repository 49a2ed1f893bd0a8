"""Metric definitions on synthetic timelines (vLLM's bench serve definitions)."""

import pytest

from steploop.bench.metrics import (
    RequestResult,
    compute_metrics,
    distribute_tokens,
    meets_slos,
    parse_goodput,
    spread_itl,
)


def _result(ttft, latency, n, itl=None):
    return RequestResult(success=True, prompt_len=10, output_tokens=n, ttft=ttft, latency=latency,
                         itl=itl if itl is not None else [(latency - ttft) / max(n - 1, 1)] * (n - 1))


def test_tpot_is_decode_time_over_tokens_after_the_first():
    r = _result(0.1, 1.1, 11)
    assert r.tpot == pytest.approx(0.1)
    assert _result(0.1, 0.1, 1).tpot is None


def test_spread_itl_splits_a_multi_token_chunk_evenly():
    assert spread_itl([1.0, 1.1, 1.5], [1, 1, 4]) == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.1])
    assert spread_itl([2.0, 2.2], [3, 1]) == pytest.approx([0.0, 0.0, 0.2])


def test_distribute_tokens_keeps_the_total_and_one_per_chunk():
    assert distribute_tokens([1, 1, 1], 3) == [1, 1, 1]
    split = distribute_tokens([1, 3, 1], 9)
    assert sum(split) == 9 and min(split) >= 1 and split[1] == max(split)
    assert distribute_tokens([], 5) == []


def test_percentiles_and_throughputs():
    results = [_result(t / 1000, t / 1000 + 0.99, 100) for t in range(1, 101)]   # ttft 1..100 ms
    results.append(RequestResult(success=False, error="boom"))
    m = compute_metrics(results, duration=10.0)
    assert m["completed"] == 100 and m["failed"] == 1
    assert m["total_output_tokens"] == 10_000 and m["total_input_tokens"] == 1000
    assert m["request_throughput"] == pytest.approx(10.0)
    assert m["output_throughput"] == pytest.approx(1000.0)
    assert m["total_token_throughput"] == pytest.approx(1100.0)
    assert m["mean_ttft_ms"] == pytest.approx(50.5)
    assert m["median_ttft_ms"] == pytest.approx(50.5)
    assert m["p99_ttft_ms"] == pytest.approx(99.01)
    assert m["p90_ttft_ms"] == pytest.approx(90.1)
    assert m["mean_tpot_ms"] == pytest.approx(10.0)
    assert m["median_itl_ms"] == pytest.approx(10.0)
    assert m["mean_e2el_ms"] == pytest.approx(1040.5)


def test_goodput_counts_requests_meeting_every_slo():
    fast, slow_ttft, slow_tpot = _result(0.05, 0.55, 11), _result(0.5, 1.0, 11), _result(0.05, 2.05, 11)
    slos = parse_goodput(["ttft:100", "tpot:100"])
    assert slos == {"ttft": 100.0, "tpot": 100.0}
    assert [meets_slos(r, slos) for r in (fast, slow_ttft, slow_tpot)] == [True, False, False]
    m = compute_metrics([fast, slow_ttft, slow_tpot], duration=2.0, slos=slos)
    assert m["request_goodput"] == pytest.approx(0.5)
    assert compute_metrics([fast], 1.0, parse_goodput(["e2el:500"]))["request_goodput"] == 0.0


@pytest.mark.parametrize("bad", ["ttft", "foo:1", "tpot:-1"])
def test_goodput_rejects_bad_slos(bad):
    with pytest.raises(ValueError):
        parse_goodput([bad])
