"""`steploop serve` as a real process for tests: started in its own session, as a shell starts a foreground job
(so os.killpg(serve.pid, ...) is what a terminal's Ctrl-C does), its log in a file, its children's pids read
from the supervisor's "started NAME (pid N)" lines."""

from __future__ import annotations

import http.client
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from tests.integration.cluster import MODEL, ROOT, Cluster, free_port


class ServeProcess:
    def __init__(self, tmp_path: pathlib.Path, *extra_args: str):
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        self.log_path = tmp_path / "serve.log"
        argv = [sys.executable, "-m", "steploop.cli", "serve", "--port", str(self.http_port), "--scheduler-port",
                str(self.grpc_port), "--metrics-port", str(self.metrics_port), *extra_args]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.cluster = Cluster(tmp_path)           # for its HTTP helpers, pointed at serve's gateway
        self.cluster.http_port = self.http_port
        self.cluster.procs = {"serve": self.proc}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 300.0) -> None:
        self.cluster.wait_ready(timeout)

    def wait_for_log(self, text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log():
            assert time.monotonic() < deadline, f"{text!r} not in the log after {timeout} s:\n{self.log()[-3000:]}"
            time.sleep(0.2)

    def pids(self, name: str) -> list[int]:
        return [int(p) for p in re.findall(rf"started {name} \(pid (\d+)\)", self.log())]

    def children(self) -> list[int]:
        return [pid for name in ("scheduler", "worker", "gateway") for pid in self.pids(name)]

    def wait_all_gone(self, timeout: float) -> float:
        """Seconds until the supervisor and every child it started are gone (exited or zombies)."""
        started = time.monotonic()
        deadline = started + timeout
        while self.proc.poll() is None or any(alive(p) for p in self.children()):
            assert time.monotonic() < deadline, (f"still running {timeout} s later: serve {self.proc.poll()}, "
                                                 f"children {[p for p in self.children() if alive(p)]}\n"
                                                 f"{self.log()[-4000:]}")
            time.sleep(0.2)
        return time.monotonic() - started

    def kill(self) -> None:
        kill_supervised(self.proc, self.children())


def kill_supervised(supervisor: subprocess.Popen, children: list[int]) -> None:
    """Test clean-up: nothing of a supervisor's outlives the test, whatever it asserted."""
    for pid in [supervisor.pid, *children]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    supervisor.wait(30)


def alive(pid: int) -> bool:
    """A zombie counts as gone: it runs nothing, and who reaps it after its parent died is init's business."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


class StreamReader(threading.Thread):
    """One streamed completion read in a thread: `first_token` is set at the first text event; afterwards `text`
    is what was streamed, `events` the decoded data events ("[DONE]" as is) and `error` what broke it, if anything."""

    def __init__(self, base_url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = base_url + "/v1/completions", {"model": MODEL, **body, "stream": True}
        self.first_token = threading.Event()
        self.events: list = []
        self.text = ""
        self.error: BaseException | None = None

    def run(self) -> None:
        req = urllib.request.Request(self.url, data=json.dumps(self.body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                for line in resp:
                    if line.startswith(b"data: "):
                        self._event(line[len(b"data: "):].strip().decode())
        except (OSError, http.client.HTTPException, ValueError) as exc:   # a cut stream: a result, for the test
            self.error = exc
        finally:
            self.first_token.set()         # never leave the test waiting on a stream that failed at once

    def _event(self, data: str) -> None:
        event = data if data == "[DONE]" else json.loads(data)
        self.events.append(event)
        if event != "[DONE]" and event.get("choices"):
            self.text += event["choices"][0].get("text") or ""
            self.first_token.set()


__all__ = ["ServeProcess", "StreamReader", "alive", "free_port", "kill_supervised"]
