"""Faults with real processes: each ends with a normal request served and every KV block free at idle."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request

import pytest

from tests.integration.cluster import MODEL, Cluster, assert_healthy_and_no_leak, is_idle_and_whole

pytestmark = pytest.mark.slow


def assert_serves(cluster: Cluster) -> None:
    """The shared end-of-fault check (cluster.assert_healthy_and_no_leak); test_bad_inputs_e2e imports this name."""
    assert_healthy_and_no_leak(cluster)


@pytest.fixture
def cluster(tmp_path, model_dir):
    c = Cluster(tmp_path).start()
    try:
        yield c
    finally:
        c.stop()


def test_scheduler_killed_gateway_answers_503_quickly_then_recovers(cluster):
    cluster.stop_service("scheduler", sig=signal.SIGKILL)
    start = time.monotonic()
    status, body = cluster.post("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 3})
    assert status == 503 and body["error"]["message"], body
    assert time.monotonic() - start < 10
    deadline = time.monotonic() + 5             # /health caches its answer for half a second
    while cluster.health() != 503 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.health() == 503
    cluster.start_service("scheduler")          # the worker reattaches, the gateway reconnects
    cluster.wait_ready(600)
    assert_healthy_and_no_leak(cluster)


def test_gateway_killed_scheduler_aborts_its_requests(cluster):
    body = b'{"model": "%s", "prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": true, ' \
           b'"stream": true}' % MODEL.encode()

    def stream_forever():
        req = urllib.request.Request(cluster.base_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                for _ in resp:
                    pass
        except Exception:
            pass                                 # the gateway dies under it

    threads = [threading.Thread(target=stream_forever, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while cluster.load_report().num_running < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    cluster.stop_service("gateway", sig=signal.SIGKILL)
    load = cluster.wait_idle(timeout=20)            # its gRPC calls are cancelled: requests aborted
    assert is_idle_and_whole(load), load
    cluster.start_service("gateway")
    cluster.wait_ready(600)
    assert_healthy_and_no_leak(cluster)


def test_sigterm_drains_in_flight_requests(cluster):
    """SIGTERM to the gateway: health NOT_SERVING, new requests 503, the in-flight stream still finishes."""
    result = {}

    def one():
        result["reply"] = cluster.post("/v1/completions", {"model": MODEL, "prompt": "Count to twenty:",
                                                           "max_tokens": 40, "ignore_eos": True})

    t = threading.Thread(target=one)
    t.start()
    deadline = time.monotonic() + 30
    while cluster.load_report().num_running < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    cluster.procs["gateway"].send_signal(signal.SIGTERM)
    t.join(60)
    status, body = result["reply"]
    assert status == 200 and body["usage"]["completion_tokens"] == 40, body
    assert cluster.procs["gateway"].wait(30) == 0
    cluster.start_service("gateway")                # the scheduler and worker served on: a new gateway is ready
    cluster.wait_ready(600)
    assert_healthy_and_no_leak(cluster)


def test_hung_worker_turns_health_off_and_back(tmp_path, model_dir):
    """A stopped (not dead) worker while work is pending: NOT_SERVING within --hang-timeout, SERVING again
    when it resumes, and the request it held still completes."""
    c = Cluster(tmp_path, scheduler_args=["--hang-timeout", "3"]).start()
    try:
        result = {}
        t = threading.Thread(target=lambda: result.update(reply=c.post(
            "/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 30, "ignore_eos": True})))
        t.start()
        deadline = time.monotonic() + 30
        while c.load_report().num_running < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        c.procs["worker"].send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 15
        while c.health() != 503 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.health() == 503
        c.procs["worker"].send_signal(signal.SIGCONT)
        t.join(120)
        status, body = result["reply"]
        assert status == 200 and body["usage"]["completion_tokens"] == 30, body
        c.wait_ready(300)
        assert_healthy_and_no_leak(c)
    finally:
        c.procs["worker"].send_signal(signal.SIGCONT)
        c.stop()
