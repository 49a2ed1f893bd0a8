"""A forward pass that raises, in the real worker process with the real model (tests/integration/faulty_worker.py
patches ModelRunner._run; production code has no hook): the requests of the failed step get a clear error in
OpenAI's shape and never hang, their KV blocks come back, the worker lives on, and the next requests are served
with the same greedy text as before the fault."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.integration.cluster import MODEL, Cluster, assert_healthy_and_no_leak
from tests.integration.faulty_worker import FAULT_MESSAGE

pytestmark = pytest.mark.slow

NORMAL_PROMPT, NORMAL_MAX_TOKENS = "The capital of France is", 16
DECODE_FAULT_AFTER = 6       # the decode fault fails the step that computes the 7th token


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def markers(tokenizer) -> dict[str, list[int]]:
    return {kind: tokenizer(f" [[steploop-fail-{kind}]]", add_special_tokens=False).input_ids
            for kind in ("prefill", "decode")}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir, markers):
    faults = [{"marker": markers["prefill"], "after_tokens": 0},
              {"marker": markers["decode"], "after_tokens": DECODE_FAULT_AFTER}]
    c = Cluster(tmp_path_factory.mktemp("forward_fault"), modules={"worker": "tests.integration.faulty_worker"},
                env={"STEPLOOP_TEST_FAULTS": json.dumps(faults)})
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def baseline(cluster) -> str:
    """The normal request's greedy text, before any fault."""
    body = assert_healthy_and_no_leak(cluster, NORMAL_PROMPT, NORMAL_MAX_TOKENS)
    return body["choices"][0]["text"]


def faulty_prompt(tokenizer, markers, kind: str, text: str) -> list[int]:
    return tokenizer(text).input_ids + markers[kind]


def assert_fault_error(status: int, body: dict) -> None:
    assert status == 500, body
    err = body["error"]
    assert err["type"] == "server_error" and err["code"] == "engine_error", body
    assert err["message"].startswith("generation failed: RuntimeError: " + FAULT_MESSAGE), body
    assert "Traceback" not in err["message"]


def stream(cluster: Cluster, body: dict, timeout: float = 60) -> tuple[int, list]:
    """POSTs a streamed completion: (200, [decoded data events, "[DONE]" as is]) or (status, error body)."""
    data = json.dumps({**body, "stream": True}).encode()
    req = urllib.request.Request(cluster.base_url + "/v1/completions", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            events = []
            for line in resp:
                line = line.decode().strip()
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    events.append(data if data == "[DONE]" else json.loads(data))
            return resp.status, events
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def assert_worker_survived(cluster: Cluster) -> None:
    assert cluster.procs["worker"].poll() is None, cluster.logs()
    log = (cluster.log_dir / "worker.log").read_text()
    assert "injecting a forward failure" in log and "detached" not in log, log[-3000:]
    assert "failed on the worker" in (cluster.log_dir / "scheduler.log").read_text()


def test_failed_prompt_step_is_a_500_for_plain_and_streamed_requests(cluster, baseline, tokenizer, markers):
    prompt = faulty_prompt(tokenizer, markers, "prefill", "Tell me a joke.")
    start = time.monotonic()
    status, body = cluster.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 10})
    assert_fault_error(status, body)
    # Streamed: the gateway awaits the first engine chunk before the 200 goes out, so the error keeps its status.
    status, body = stream(cluster, {"model": MODEL, "prompt": prompt, "max_tokens": 10})
    assert_fault_error(status, body)
    assert time.monotonic() - start < 60           # two one-step failures: seconds, even on a loaded machine
    assert_worker_survived(cluster)
    assert_healthy_and_no_leak(cluster, NORMAL_PROMPT, NORMAL_MAX_TOKENS, expect_text=baseline)


def test_failed_decode_step_ends_the_stream_with_an_error_and_fails_its_whole_step(cluster, baseline, tokenizer,
                                                                                     markers):
    """A request running beside the faulty one shares its step, so it fails with the same error: a step is the
    unit that fails (Scheduler._fail_plan). Tokens already streamed stay streamed."""
    result = {}

    def bystander():
        result["reply"] = cluster.post("/v1/completions", {"model": MODEL, "prompt": "Once upon a time",
                                                           "max_tokens": 300, "ignore_eos": True, "temperature": 0})

    t = threading.Thread(target=bystander, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while cluster.load_report().num_running < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cluster.load_report().num_running == 1, "the bystander never started"
    start = time.monotonic()
    status, events = stream(cluster, {"model": MODEL, "temperature": 0, "max_tokens": 50, "ignore_eos": True,
                                      "prompt": faulty_prompt(tokenizer, markers, "decode", "Count to ten:")})
    assert status == 200, events
    assert events[-1] == "[DONE]" and "error" in events[-2], events
    assert_fault_error(500, events[-2])
    text_events = events[:-2]
    assert text_events and all(e["choices"] and e["choices"][0]["finish_reason"] is None for e in text_events), events
    assert "".join(e["choices"][0]["text"] for e in text_events), events   # the tokens before the fault
    t.join(60)
    assert not t.is_alive(), "the request sharing the failed step hangs"
    assert_fault_error(*result["reply"])
    assert time.monotonic() - start < 120
    assert_worker_survived(cluster)
    assert_healthy_and_no_leak(cluster, NORMAL_PROMPT, NORMAL_MAX_TOKENS, expect_text=baseline)
