"""The supervisor's signals, with real processes (three fake services, tests/serve/fake_service.py): whatever
stops it, it stops them one at a time in its stop order; a second signal kills them at once; a killed supervisor
leaves nothing running. The supervisor runs in its own session, as a shell runs a foreground job, so
os.killpg(its pid, SIGINT) is exactly a terminal's Ctrl-C."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.cluster import ROOT
from tests.integration.serve_process import alive, kill_supervised

NAMES = ("scheduler", "worker", "gateway")


class FakeCluster:
    def __init__(self, tmp_path: pathlib.Path, drain_s: float):
        self.events_path, self.log_path = tmp_path / "events", tmp_path / "supervisor.log"
        self.events_path.touch()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.serve.fake_cluster", str(self.events_path),
                                          str(drain_s)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.wait_for(lambda events: all(f"{name} ready" in events for name in NAMES))

    def events(self) -> list[str]:
        return self.events_path.read_text().splitlines()

    def wait_for(self, condition, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition(self.events()):
            assert time.monotonic() < deadline, f"{self.events()}\n{self.log_path.read_text()}"
            time.sleep(0.05)

    def children(self) -> list[int]:
        return [int(pid) for pid in re.findall(r"started \w+ \(pid (\d+)\)", self.log_path.read_text())]

    def kill_all(self) -> None:
        kill_supervised(self.proc, self.children())


def wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, [pid for pid in pids if alive(pid)]
        time.sleep(0.05)


@pytest.mark.parametrize("sig, to_group", [
    pytest.param(signal.SIGINT, True, id="ctrl-c-to-the-group"), pytest.param(signal.SIGINT, False, id="SIGINT"),
    pytest.param(signal.SIGTERM, False, id="SIGTERM"), pytest.param(signal.SIGHUP, False, id="SIGHUP")])
def test_every_stop_signal_runs_the_same_ordered_drain(tmp_path, sig, to_group):
    cluster = FakeCluster(tmp_path, drain_s=0.3)
    try:
        (os.killpg if to_group else os.kill)(cluster.proc.pid, sig)
        code = cluster.proc.wait(60)
        children = cluster.children()
        wait_gone(children, 10)
    finally:
        cluster.kill_all()
    assert code == 0, cluster.log_path.read_text()
    assert len(children) == 3
    assert [e for e in cluster.events() if "ready" not in e] == [
        "gateway SIGTERM", "gateway stopped", "scheduler SIGTERM", "scheduler stopped", "worker SIGTERM",
        "worker stopped"]            # and no child ever saw the SIGINT


def test_a_second_signal_kills_at_once(tmp_path):
    cluster = FakeCluster(tmp_path, drain_s=300)            # a drain that would outlast the test
    try:
        os.killpg(cluster.proc.pid, signal.SIGINT)
        cluster.wait_for(lambda events: "gateway SIGTERM" in events)
        started = time.monotonic()
        os.killpg(cluster.proc.pid, signal.SIGINT)
        code = cluster.proc.wait(30)
        children = cluster.children()
        wait_gone(children, 10)
        took = time.monotonic() - started
    finally:
        cluster.kill_all()
    assert code == 128 + signal.SIGINT
    assert took < 20, took                                  # not the 60 s stop timeout, nor the 300 s drain
    assert "SIGINT again: killing the services now" in cluster.log_path.read_text()
    assert "gateway stopped" not in cluster.events() and "scheduler SIGTERM" not in cluster.events()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_supervisor_takes_its_children_with_it(tmp_path):
    cluster = FakeCluster(tmp_path, drain_s=0.3)
    try:
        children = cluster.children()
        cluster.proc.kill()                                 # SIGKILL: no handler of the supervisor runs
        cluster.proc.wait(10)
        wait_gone(children, 30)
    finally:
        cluster.kill_all()
    assert sorted(e for e in cluster.events() if "ready" not in e) == sorted(
        f"{name} {event}" for name in NAMES for event in ("SIGTERM", "stopped"))    # each drained on its own
