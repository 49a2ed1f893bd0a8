"""Supervisor: runs services as child processes, restarts one that dies, stops all on SIGINT/SIGTERM.

Children get SIGTERM one at a time in reverse start order (gateway first, so in-flight requests drain while the
engine behind them is still up) and SIGKILL after stop_timeout. A service that dies more than `max_restarts` times in `restart_window` seconds
is not restarted again: the whole cluster stops and `run` returns 1.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("steploop.supervisor")


@dataclass
class ServiceSpec:
    name: str
    argv: list[str]
    env: dict[str, str]
    process: asyncio.subprocess.Process | None = None
    restarts: list[float] = field(default_factory=list)


class Supervisor:
    def __init__(self, specs: list[ServiceSpec], health_url: str, ready_timeout: float = 600.0,
                 stop_timeout: float = 35.0, max_restarts: int = 5, restart_window: float = 60.0):
        self.specs = specs
        self.health_url = health_url
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.max_restarts = max_restarts
        self.restart_window = restart_window
        self._stopping = asyncio.Event()

    async def run(self, on_ready: Callable[[], None] = lambda: None) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stopping.set)
        for spec in self.specs:
            await self._start(spec)
        watchers = [asyncio.create_task(self._watch(spec)) for spec in self.specs]
        ready = asyncio.create_task(self._wait_ready(on_ready))
        await self._stopping.wait()
        ready.cancel()
        code = 1 if any(w.done() and w.result() == "gave up" for w in watchers) else 0
        await self._stop_all()
        for w in watchers:
            w.cancel()
        return code

    async def _start(self, spec: ServiceSpec) -> None:
        spec.process = await asyncio.create_subprocess_exec(*spec.argv, env=spec.env)
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
        """One at a time, gateway first: each drains while the services behind it are still up."""
        for spec in reversed(self.specs):
            if spec.process is None or spec.process.returncode is not None:
                continue
            spec.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(spec.process.wait(), self.stop_timeout)
            except asyncio.TimeoutError:
                log.warning("%s did not stop within %.0f s; killing it", spec.name, self.stop_timeout)
                spec.process.kill()
                await spec.process.wait()
        log.info("all services stopped")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except Exception:
        return False
