"""N ranks of a ModelRunner as separate processes (spawned) over a real gloo group on loopback, each serving the
same schedules through the test driver: the mixture-of-experts tests' runner (tests/tp/test_moe_tp.py).

The parent serves the group's TCPStore; every rank connects to it, forms the group, runs every schedule of
tests/worker/test_families.py (whole prompts, uneven chunks, a preemption) and sends back (tokens, logprobs) per
prompt and schedule, or the error it hit.
"""

from __future__ import annotations

import multiprocessing
import pathlib
import queue
import traceback
from datetime import timedelta

SCHEDULES = [(512, None), ({0: 7, 1: 64, 2: 5}, None), (16, 8)]   # (chunk, preempt after step)


def _rank_main(rank: int, world_size: int, model_dir: str, address: str, expert_parallel: bool, out) -> None:
    try:
        import torch

        from steploop.gpu_worker.config import WorkerConfig
        from steploop.gpu_worker.distributed.process_group import form_group
        from steploop.gpu_worker.model_runner import ModelRunner
        from tests.worker.test_families import serve

        config = WorkerConfig(model=model_dir, num_kv_blocks=64, max_model_len=256, device="cpu", dtype="float32",
                              tensor_parallel_size=world_size, rank=rank, num_threads=1,
                              enable_expert_parallel=expert_parallel)
        runner = ModelRunner.from_config(config, pathlib.Path(model_dir))
        timeout = timedelta(seconds=120)
        group = form_group(rank, world_size, address, 1, timeout, "127.0.0.1", torch.device("cpu"), None)
        runner.tp_comm.attach(group, 1, timeout)
        out.put((rank, [serve(runner, chunk, preempt) for chunk, preempt in SCHEDULES], None))
    except BaseException:  # noqa: BLE001 - reported by the parent
        out.put((rank, None, traceback.format_exc()))


def run_rank_processes(model_dir: pathlib.Path, world_size: int, expert_parallel: bool = False,
                       timeout: float = 600.0) -> list[list[dict]]:
    """Per rank, per schedule: handle -> (tokens, logprobs)."""
    from steploop.gpu_worker.distributed.process_group import GroupStore

    store = GroupStore("127.0.0.1", world_size)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, str(model_dir), store.address, expert_parallel,
                                                   out), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: list = [None] * world_size
    try:
        for _ in range(world_size):
            try:
                rank, served, error = out.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"a rank sent nothing in {timeout:g} s") from None
            if error:
                raise AssertionError(f"rank {rank} failed:\n{error}")
            results[rank] = served
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return results
