"""N ranks of a ModelRunner as separate processes (spawned) over a real gloo group on loopback, each serving the
same schedules through the test driver: the mixture-of-experts tests' runner (tests/tp/test_moe_tp.py).

The parent serves the group's TCPStore; every rank connects to it, forms the group, runs every schedule of
tests/worker/test_families.py (whole prompts, uneven chunks, a preemption; PREFIX_HIT: a repeated prompt hitting the
cached blocks, tests/worker/prefix_hit.py) and sends back (tokens, logprobs) per prompt and schedule, or the error
it hit; run_ranks also sends what each rank holds its weights in (weight_report).
"""

from __future__ import annotations

import multiprocessing
import pathlib
import queue
import traceback
from datetime import timedelta

SCHEDULES = [(512, None), ({0: 7, 1: 64, 2: 5}, None), (16, 8)]   # (chunk, preempt after step)
PREFIX_HIT = ("prefix-hit", None)


def weight_report(model) -> dict:
    """fp32_matrices: every float32 weight of 2+ dimensions left in the model (name -> bytes); stored_bytes: the
    bytes held in a stored (packed / quantized / block) form."""
    from steploop.gpu_worker.gguf.block_embedding import BlockEmbedding
    from steploop.gpu_worker.model.moe import SparseMoE
    from steploop.gpu_worker.model.quant.linear import QuantLinear
    fp32 = {n: p.numel() * 4 for n, p in model.named_parameters() if p.dtype.is_floating_point and p.dim() >= 2}
    stored = 0
    for module in model.modules():
        if isinstance(module, (QuantLinear, BlockEmbedding)):
            stored += module.nbytes
        elif getattr(module, "packed", None) is not None and not isinstance(module, QuantLinear):
            stored += module.packed.nbytes
        if isinstance(module, SparseMoE):
            for weight in module.packed_experts.values():
                stored += sum(w.nbytes for w in (weight if isinstance(weight, list) else [weight]))
    return {"fp32_matrices": fp32, "stored_bytes": stored}


def _rank_main(rank: int, world_size: int, model_dir: str, address: str, expert_parallel: bool, out,
               schedules=SCHEDULES) -> None:
    try:
        import torch

        from steploop.gpu_worker.config import WorkerConfig
        from steploop.gpu_worker.distributed.process_group import form_group
        from steploop.gpu_worker.model_runner import ModelRunner
        from tests.worker.prefix_hit import serve_prefix_hit
        from tests.worker.test_families import serve

        config = WorkerConfig(model=model_dir, num_kv_blocks=64, max_model_len=256, device="cpu", dtype="float32",
                              tensor_parallel_size=world_size, rank=rank, num_threads=1,
                              enable_expert_parallel=expert_parallel)
        runner = ModelRunner.from_config(config, pathlib.Path(model_dir))
        timeout = timedelta(seconds=120)
        group = form_group(rank, world_size, address, 1, timeout, "127.0.0.1", torch.device("cpu"), None)
        runner.tp_comm.attach(group, 1, timeout)
        served = [serve_prefix_hit(runner) if (chunk, preempt) == PREFIX_HIT else serve(runner, chunk, preempt)
                  for chunk, preempt in schedules]
        out.put((rank, (served, weight_report(runner.model)), None))
    except BaseException:  # noqa: BLE001 - reported by the parent
        out.put((rank, None, traceback.format_exc()))


def run_rank_processes(model_dir: pathlib.Path, world_size: int, expert_parallel: bool = False,
                       timeout: float = 600.0) -> list[list[dict]]:
    """Per rank, per schedule of SCHEDULES: handle -> (tokens, logprobs)."""
    return [served for served, _ in run_ranks(model_dir, world_size, expert_parallel, timeout)]


def run_ranks(model_dir: pathlib.Path, world_size: int, expert_parallel: bool = False, timeout: float = 600.0,
              schedules=SCHEDULES) -> list[tuple[list[dict], dict]]:
    """Per rank: (per schedule: handle -> (tokens, logprobs); its weight_report)."""
    from steploop.gpu_worker.distributed.process_group import GroupStore

    store = GroupStore("127.0.0.1", world_size)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, str(model_dir), store.address, expert_parallel,
                                                   out, schedules), daemon=True) for r in range(world_size)]
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
