"""`steploop serve` owns its children's signals: a terminal's Ctrl-C (SIGINT to the whole foreground process
group) runs the same ordered drain as SIGTERM, a second one stops at once, and no child outlives a killed
supervisor."""

from __future__ import annotations

import os
import signal
import threading

import openai
import pytest

from tests.integration.serve_process import MODEL, ServeProcess, StreamReader

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
    # an ordered stop is not a fault: no service logs a warning from the signal on
    stop = log[log.index("SIGINT: stopping"):]
    assert not [line for line in stop.splitlines() if " WARNING " in line or " ERROR " in line], stop
    print(f"all processes gone {gone_after:.1f} s after the stream ended")


def test_a_stream_that_outlives_the_shutdown_timeout_ends_with_an_error_and_done(tmp_path):
    """The drain deadline cuts a stream with a shutting_down error event and [DONE]: the openai SDK raises its
    APIError naming the shutdown, not APIConnectionError, which a client could not tell from a network fault."""
    serve = ServeProcess(tmp_path, "--num-kv-blocks", "600", "--shutdown-timeout", "2")
    long_stream = {**STREAM, "max_tokens": 4000}
    sdk: dict = {}
    sdk_first_token = threading.Event()

    def read_with_the_sdk() -> None:
        client = openai.OpenAI(base_url=serve.cluster.base_url + "/v1", api_key="unused", max_retries=0)
        try:
            body = {k: v for k, v in long_stream.items() if k != "ignore_eos"}
            for _ in client.completions.create(model=MODEL, stream=True, extra_body={"ignore_eos": True}, **body):
                sdk_first_token.set()
        except Exception as exc:  # noqa: BLE001 - what the SDK raised is the result under test
            sdk["error"] = exc
        finally:
            sdk_first_token.set()

    raw = StreamReader(serve.cluster.base_url, long_stream)
    sdk_reader = threading.Thread(target=read_with_the_sdk, daemon=True)
    try:
        serve.wait_ready()
        raw.start()
        sdk_reader.start()
        assert raw.first_token.wait(120) and raw.error is None, raw.error
        assert sdk_first_token.wait(120) and "error" not in sdk, sdk
        os.killpg(serve.proc.pid, signal.SIGINT)
        raw.join(60)
        sdk_reader.join(60)
        gone_after = serve.wait_all_gone(120)
        log = serve.log()
    finally:
        serve.kill()
    assert not raw.is_alive() and not sdk_reader.is_alive()
    assert raw.error is None, f"{raw.error!r}\n{log[-4000:]}"
    assert raw.events[-1] == "[DONE]", raw.events[-3:]
    error = raw.events[-2]["error"]
    assert error["code"] == "shutting_down" and "--shutdown-timeout 2 s" in error["message"], error
    assert isinstance(sdk.get("error"), openai.APIError), repr(sdk.get("error"))
    assert not isinstance(sdk["error"], openai.APIConnectionError), repr(sdk["error"])
    assert "shutting down" in str(sdk["error"]), str(sdk["error"])
    assert serve.proc.returncode == 0, log[-4000:]
    print(f"cut after {len(raw.text)} characters; all processes gone {gone_after:.1f} s after SIGINT")


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
