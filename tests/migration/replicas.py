"""Several scheduler replicas, each with its own worker, behind one gateway (real processes, tests/integration's
Cluster), and the steps of a migration test: pin new requests to one replica (the others' schedulers are stopped
with SIGSTOP until the gateway's health poll marks them down), wait until its streams are mid-generation, let the
others serve again, then make the victim fail."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import time
import urllib.request

from tests.integration.cluster import Cluster, free_port


class Replicas:
    def __init__(self, root: pathlib.Path, count: int, gateway_args=(), netns: dict | None = None):
        """Replica 0's Cluster runs the gateway. netns: replica index -> (argv prefix, address): that replica's
        scheduler and worker run in a network namespace, the scheduler bound to the address the gateway reaches
        it at."""
        self.clusters = []
        for i in range(count):
            (root / f"replica-{i}").mkdir(exist_ok=True)
            prefix, host = (netns or {}).get(i, ([], None))
            c = Cluster(root / f"replica-{i}", num_kv_blocks=1200, prefixes={"scheduler": prefix, "worker": prefix})
            if host is not None:
                c.scheduler_address = f"{host}:{c.grpc_port}"
                c.argv["scheduler"] += ["--scheduler-host", host]
                c.argv["worker"][c.argv["worker"].index("--scheduler-address") + 1] = c.scheduler_address
            self.clusters.append(c)
        gateway = self.clusters[0]
        for c in self.clusters[1:]:
            c.http_port = free_port()
        addresses = ",".join(c.scheduler_address for c in self.clusters)
        gateway.argv["gateway"][gateway.argv["gateway"].index("--scheduler-address") + 1] = addresses
        gateway.argv["gateway"] += list(gateway_args)

    @property
    def gateway(self) -> Cluster:
        return self.clusters[0]

    def start(self) -> "Replicas":
        for c in self.clusters[1:]:
            for name in ("scheduler", "worker"):
                c.start_service(name)
        self.gateway.start()
        for c in self.clusters[1:]:       # every replica has its worker (the gateway answers with any one)
            wait_for(lambda c=c: c.load_report().num_total_blocks > 0, 600, f"{c.scheduler_address} has no worker")
        self.gateway.wait_replicas_up([c.scheduler_address for c in self.clusters], timeout=60)
        return self

    def stop(self) -> None:
        for c in self.clusters:
            for proc in c.procs.values():
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGCONT)
            c.stop()

    def metrics(self) -> str:
        with urllib.request.urlopen(self.gateway.base_url + "/metrics", timeout=30) as resp:
            return resp.read().decode()

    def replica_up(self) -> dict[str, float]:
        return {m[1]: float(m[2]) for m in re.finditer(r'steploop:replica_up\{replica="([^"]+)"\} (\S+)',
                                                        self.metrics())}

    def migrations(self) -> dict[str, float]:
        return {m[1]: float(m[2]) for m in re.finditer(
            r'steploop:request_migrations_total\{reason="([^"]+)"\} (\S+)', self.metrics())}

    def pause_all_but(self, victim: int) -> None:
        """SIGSTOP every other replica's scheduler and wait until the gateway routes around them."""
        others = [c for i, c in enumerate(self.clusters) if i != victim]
        for c in others:
            os.kill(c.procs["scheduler"].pid, signal.SIGSTOP)
        wait_for(lambda: all(self.replica_up().get(c.scheduler_address) == 0.0 for c in others), 60, "others down")

    def resume_all_but(self, victim: int) -> None:
        others = [c for i, c in enumerate(self.clusters) if i != victim]
        for c in others:
            os.kill(c.procs["scheduler"].pid, signal.SIGCONT)
        wait_for(lambda: all(self.replica_up().get(c.scheduler_address) == 1.0 for c in others), 60, "others up")


def wait_for(condition, timeout: float, what: str, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for: {what}")
        time.sleep(interval)
