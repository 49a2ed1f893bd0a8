"""TpCluster: gateway, scheduler and N worker ranks (`worker-0` .. `worker-{N-1}`) as real processes on loopback.

Each rank is `python -m steploop.gpu_worker -tp N --rank R` with one CPU thread (the machine has 2 cores); the
scheduler runs `-tp N`. With pipeline_parallel_size P the N ranks are -tp N/P -pp P. Ranks start in reverse order on purpose: the group must not depend on who comes first.
"""

from __future__ import annotations

import pathlib

from tests.integration.cluster import Cluster


class TpCluster(Cluster):
    def __init__(self, log_dir: pathlib.Path, world_size: int, model: str | None = None, scheduler_args=(),
                 worker_args=(), num_kv_blocks: int = 640, collective_timeout: float = 20.0,
                 pipeline_parallel_size: int = 1, **kwargs):
        model_args = ["--model", model] if model else []
        sizes = ["-tp", str(world_size // pipeline_parallel_size), "-pp", str(pipeline_parallel_size)]
        super().__init__(log_dir, scheduler_args=[*sizes, "--tp-collective-timeout",
                                                  str(collective_timeout), *scheduler_args],
                         worker_args=model_args, gateway_args=model_args, num_kv_blocks=num_kv_blocks, **kwargs)
        self.world_size = world_size
        base = self.argv.pop("worker")
        for rank in range(world_size):
            self.argv[f"worker-{rank}"] = [*base, *sizes, "--rank", str(rank), "--num-threads",
                                           "1", *worker_args]
        self.modules.update({f"worker-{r}": self.modules.get("worker", "steploop.gpu_worker")
                             for r in range(world_size)})

    @property
    def ranks(self) -> list[str]:
        return [f"worker-{r}" for r in range(self.world_size)]

    def start(self, timeout: float = 600.0) -> TpCluster:
        for name in ("scheduler", *reversed(self.ranks), "gateway"):
            self.start_service(name)
        self.wait_ready(timeout)
        return self

    def stop(self) -> None:
        for name in ("gateway", "scheduler", *self.ranks):
            if name in self.procs:
                self.stop_service(name, timeout=15)
