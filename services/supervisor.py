"""Supervisor: runs services as child processes, restarts one that dies, stops all on SIGINT/SIGTERM/SIGHUP.

The children run in their own sessions, so a terminal's Ctrl-C (SIGINT to the whole foreground process group)
reaches the supervisor alone, and Ctrl-C, SIGINT and SIGTERM to the supervisor all run the same ordered stop:
SIGTERM to one child at a time in `stop_order` (serve's: gateway, scheduler, worker, so each drains while what
it needs is still up: the gateway its streams, the scheduler the requests of direct gRPC clients), SIGKILL after
stop_timeout. A second signal while stopping kills what is left at
once. On Linux each child also gets SIGTERM when the supervisor dies (PR_SET_PDEATHSIG), even by SIGKILL, so no
service outlives it. A service that dies more than `max_restarts` times in `restart_window` seconds is not
restarted again: the whole cluster stops and `run` returns 1.
"""

from __future__ import annotations

import asyncio
import ctypes
import http.client
import logging
import os
import signal
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("steploop.supervisor")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PR_SET_PDEATHSIG = 1        # <linux/prctl.h>


@dataclass
class ServiceSpec:
    name: str
    argv: list[str]
    env: dict[str, str]
    process: asyncio.subprocess.Process | None = None
    restarts: list[float] = field(default_factory=list)


class Supervisor:
    def __init__(self, specs: list[ServiceSpec], health_url: str, ready_timeout: float = 600.0,
                 stop_timeout: float = 35.0, max_restarts: int = 5, restart_window: float = 60.0,
                 stop_order: list[str] | None = None):
        self.specs = specs
        self.stop_order = stop_order or [spec.name for spec in reversed(specs)]
        self.health_url = health_url
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.max_restarts = max_restarts
        self.restart_window = restart_window
        self._stopping = asyncio.Event()
        self._kill_now = asyncio.Event()      # a second signal while stopping: no more draining
        self._forced_by: int | None = None    # that signal's number

    async def run(self, on_ready: Callable[[], None] = lambda: None) -> int:
        """0 after a clean stop, 1 when a service gave up, 128 + the signal when a second signal forced it."""
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        for spec in self.specs:
            await self._start(spec)
        watchers = [asyncio.create_task(self._watch(spec)) for spec in self.specs]
        ready = asyncio.create_task(self._wait_ready(on_ready))
        await self._stopping.wait()
        ready.cancel()
        code = 1 if any(w.done() and w.result() == "gave up" for w in watchers) else 0
        for w in watchers:          # before stopping: a watcher between restarts must not start a child again
            w.cancel()
        await self._stop_all()
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
        return 128 + self._forced_by if self._forced_by is not None else code

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if not self._stopping.is_set():
            log.info("%s: stopping (gateway first, draining in-flight requests; then scheduler, then worker); "
                     "a second Ctrl-C or SIGTERM stops at once", name)
            self._stopping.set()
        elif not self._kill_now.is_set():
            log.warning("%s again: killing the services now, without draining", name)
            self._forced_by = sig
            self._kill_now.set()

    async def _start(self, spec: ServiceSpec) -> None:
        spec.process = await asyncio.create_subprocess_exec(*spec.argv, env=spec.env, start_new_session=True,
                                                            preexec_fn=_die_with_parent())
        log.info("started %s (pid %d)", spec.name, spec.process.pid)

    async def _watch(self, spec: ServiceSpec) -> str:
        while True:
            code = await spec.process.wait()
            if self._stopping.is_set():
                return "stopped"
            if code == 2:       # the services' exit code for a bad flag: restarting cannot help
                log.error("%s exited with code 2 (a configuration error; its message is above); stopping the "
                          "cluster", spec.name)
                self._stopping.set()
                return "gave up"
            now = time.monotonic()
            spec.restarts = [t for t in spec.restarts if now - t < self.restart_window] + [now]
            if len(spec.restarts) > self.max_restarts:
                log.error("%s died %d times in %.0f s (last exit code %s); stopping the cluster", spec.name,
                          len(spec.restarts), self.restart_window, code)
                self._stopping.set()
                return "gave up"
            log.error("%s exited with code %s; restarting it", spec.name, code)
            await asyncio.sleep(min(0.5 * len(spec.restarts), 5.0))
            await self._start(spec)

    async def _wait_ready(self, on_ready: Callable[[], None]) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if await asyncio.to_thread(_http_ok, self.health_url):
                on_ready()
                return
            await asyncio.sleep(0.5)
        log.error("not ready after %.0f s (%s never answered 200); stopping", self.ready_timeout, self.health_url)
        self._stopping.set()

    async def _stop_all(self) -> None:
        """One at a time, in stop_order: each drains while the services behind it are still up."""
        by_name = {spec.name: spec for spec in self.specs}
        for spec in [by_name[name] for name in self.stop_order]:
            if spec.process is not None and spec.process.returncode is None:
                await self._stop_one(spec)
        log.info("all services stopped")

    async def _stop_one(self, spec: ServiceSpec) -> None:
        """SIGTERM, then SIGKILL after stop_timeout or as soon as a second signal asks for it."""
        if not self._kill_now.is_set():
            spec.process.send_signal(signal.SIGTERM)
            exited = asyncio.ensure_future(spec.process.wait())
            forced = asyncio.ensure_future(self._kill_now.wait())
            done, _ = await asyncio.wait({exited, forced}, timeout=self.stop_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            forced.cancel()
            if exited in done:
                return
            if forced not in done:
                log.warning("%s did not stop within %.0f s; killing it", spec.name, self.stop_timeout)
        spec.process.kill()
        await spec.process.wait()


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn for Linux: the child gets SIGTERM (and drains) when the supervisor dies, however it dies.
    prctl is looked up here, in the parent, so the forked child only makes the call."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    supervisor_pid = os.getpid()

    def set_parent_death_signal() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != supervisor_pid:     # the supervisor died before prctl took effect
            os._exit(1)
    return set_parent_death_signal


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (OSError, http.client.HTTPException):    # not up yet, or not answering HTTP yet
        return False
