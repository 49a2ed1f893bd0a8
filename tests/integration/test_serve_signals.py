"""`steploop serve` owns its children's signals: a terminal's Ctrl-C (SIGINT to the whole foreground process
group) runs the same ordered drain as SIGTERM, a second one stops at once, and no child outlives a killed
supervisor."""

from __future__ import annotations

import os
import signal

import pytest

from tests.integration.serve_process import ServeProcess, StreamReader

pytestmark = pytest.mark.slow

# Generous for a loaded 2-core machine: a stream here may run at a few tokens per second.
DRAIN_ARGS = ("--num-kv-blocks", "600", "--shutdown-timeout", "180")
STREAM = {"prompt": "Count from one to one hundred:", "max_tokens": 16, "temperature": 0, "ignore_eos": True}


def test_ctrl_c_to_the_process_group_drains_a_running_stream(tmp_path):
    serve = ServeProcess(tmp_path, *DRAIN_ARGS)
    try:
        serve.wait_ready()
        status, reference = serve.cluster.post("/v1/completions", {"model": "SmolLM2-135M-Instruct", **STREAM})
        assert status == 200, reference
        stream = StreamReader(serve.cluster.base_url, STREAM)
        stream.start()
        assert stream.first_token.wait(120) and stream.error is None, stream.error
        os.killpg(serve.proc.pid, signal.SIGINT)               # what Ctrl-C in the terminal sends
        stream.join(240)
        gone_after = serve.wait_all_gone(240)
        log = serve.log()
    finally:
        serve.kill()
    assert stream.error is None, f"{stream.error!r}\n{log[-4000:]}"
    assert stream.events[-1] == "[DONE]", stream.events[-3:]
    assert stream.text == reference["choices"][0]["text"]      # the whole greedy text, not a cut one
    assert [e["choices"][0]["finish_reason"] for e in stream.events[:-1] if e["choices"][0].get("finish_reason")
            ] == ["length"]
    assert serve.proc.returncode == 0, log[-4000:]
    # the order of the drain: the gateway stopped (after its stream) before the scheduler and the worker
    assert log.index("gateway stopped") < log.index("scheduler stopped") < log.index("worker stopped"), log[-4000:]
    print(f"all processes gone {gone_after:.1f} s after the stream ended")


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    serve = ServeProcess(tmp_path, *DRAIN_ARGS)
    try:
        serve.wait_ready()
        long_stream = StreamReader(serve.cluster.base_url, {**STREAM, "max_tokens": 4000})
        long_stream.start()
        assert long_stream.first_token.wait(120) and long_stream.error is None, long_stream.error
        os.killpg(serve.proc.pid, signal.SIGINT)
        serve.wait_for_log("shutting down: draining")   # the gateway drains; this stream would take minutes
        assert serve.proc.poll() is None
        os.killpg(serve.proc.pid, signal.SIGINT)
        gone_after = serve.wait_all_gone(30)
        log = serve.log()
    finally:
        serve.kill()
    assert serve.proc.returncode == 128 + signal.SIGINT, log[-4000:]
    assert "SIGINT again: killing the services now" in log
    print(f"all processes gone {gone_after:.1f} s after the second SIGINT")


def test_no_service_outlives_a_killed_supervisor(tmp_path):
    serve = ServeProcess(tmp_path, "--num-kv-blocks", "600")
    try:
        serve.wait_ready()
        children = serve.children()
        assert len(children) == 3
        serve.proc.send_signal(signal.SIGKILL)        # no handler runs: the children learn it from the kernel
        gone_after = serve.wait_all_gone(120)
    finally:
        serve.kill()
    print(f"all 3 services gone {gone_after:.1f} s after the supervisor was SIGKILLed")
