"""`steploop serve --disaggregated-prefill`: a decode group and a prefill group (each of -tp ranks) under the one
scheduler, and the flag combinations it refuses before starting anything."""

from __future__ import annotations

import pytest

from steploop import serve


def specs(*argv: str):
    parser = serve.build_parser()
    args = parser.parse_args(list(argv))
    args.scheduler_address = serve.own_scheduler_address(args)
    return args, serve.worker_specs(args, serve.child_environment(parser, args))


def test_two_workers_one_per_role_the_prefill_one_without_tiers():
    args, workers = specs("--disaggregated-prefill", "--kv-offloading-size", "1", "--worker-metrics-port", "9100")
    serve.validate_configs(args)
    decode, prefill = workers
    assert (decode.name, prefill.name) == ("worker", "worker-prefill")
    assert decode.env["STEPLOOP_KV_ROLE"] == "decode" and decode.env["STEPLOOP_KV_OFFLOADING_SIZE"] == "1.0"
    assert prefill.env["STEPLOOP_KV_ROLE"] == "prefill" and prefill.env["STEPLOOP_KV_OFFLOADING_SIZE"] == "0"
    assert prefill.env["STEPLOOP_WORKER_METRICS_PORT"] == "9101"


@pytest.mark.parametrize("extra, words", [((), "--kv-offloading-size > 0"),
                                          (("--kv-offloading-size", "1", "--kv-role", "decode"), "drop --kv-role")])
def test_refused_without_a_landing_tier_or_with_a_role(extra, words):
    args, _ = specs("--disaggregated-prefill", *extra)
    with pytest.raises(ValueError, match=words):
        serve.validate_configs(args)


def test_without_the_flag_one_worker_serves_everything():
    _, workers = specs()
    assert [w.name for w in workers] == ["worker"] and workers[0].env["STEPLOOP_KV_ROLE"] == ""


def test_with_tp_two_each_group_gets_its_ranks_and_its_share_of_the_cpus():
    import os

    args, workers = specs("--disaggregated-prefill", "--kv-offloading-size", "1", "-tp", "2",
                          "--worker-metrics-port", "9100")
    serve.validate_configs(args)
    assert [w.name for w in workers] == ["worker", "worker-1", "worker-prefill", "worker-prefill-1"]
    assert [w.env["STEPLOOP_KV_ROLE"] for w in workers] == ["decode", "decode", "prefill", "prefill"]
    assert [w.env["STEPLOOP_RANK"] for w in workers] == ["0", "1", "0", "1"]
    assert [w.env["STEPLOOP_WORKER_METRICS_PORT"] for w in workers] == ["9100", "9101", "9102", "9103"]
    threads = str(max(1, len(os.sched_getaffinity(0)) // 4))
    assert all(w.env["STEPLOOP_NUM_THREADS"] == threads for w in workers)
