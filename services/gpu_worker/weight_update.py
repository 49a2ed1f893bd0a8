"""WeightUpdater: a worker rank's half of /update_weights_from_disk, in two phases so a tensor-parallel group
switches on every rank or on none (the scheduler's engine_control.py drives them, between steps):

    load(path)    builds a second model from the checkpoint beside the serving one (the same kernel plan, this
                  rank's shard): its config must be the served architecture's and every tensor's shape must match
                  (the loader checks each), else an error and nothing changes
    swap(commit)  commit: the loaded model serves from the next step (its C decoder bound to the same KV cache,
                  CUDA graphs captured again); else it is dropped. Either way the staged copy goes.

Loading beside the old weights needs room for a second copy for a moment (host memory on the CPU); the old model
is freed at the switch. The KV cache is kept: the scheduler preempted every request and cleared the prefix cache
first, so no block computed with the old weights is read again.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import time
from collections.abc import Callable

from steploop.common.pb.steploop.v1 import worker_pb2
from steploop.gpu_worker.model.model_config import ModelConfig
from steploop.gpu_worker.sleep_mode import give_back_memory, rss_bytes

log = logging.getLogger(__name__)

# config fields that may differ between checkpoints of one architecture (EOS comes from the scheduler's hello)
_FREE_FIELDS = {"eos_token_ids"}


def architecture_differences(served: ModelConfig, other: ModelConfig) -> list[str]:
    """The config fields that differ, as 'field: served -> other'."""
    return [f"{f.name}: {getattr(served, f.name)!r} -> {getattr(other, f.name)!r}"
            for f in dataclasses.fields(served)
            if f.name not in _FREE_FIELDS and getattr(served, f.name) != getattr(other, f.name)]


class WeightUpdater:
    def __init__(self, runner, load: Callable[[pathlib.Path], object], config: ModelConfig,
                 path: pathlib.Path | None = None) -> None:
        self.runner = runner          # its .model is replaced at a committed swap
        self._load = load             # path -> a model built and loaded like the serving one
        self.config = config          # the served architecture (the whole model's, not a rank's share)
        self.path = path              # the served weights' folder (sleep level 2 reloads from it)
        self.staged = None
        self._staged_path: pathlib.Path | None = None

    def load(self, path: str) -> str:
        """'' when the checkpoint is loaded and staged; else why not (nothing staged)."""
        self.staged = None
        if getattr(self.runner, "lora", None) is not None:
            return "weight updates are not supported with --enable-lora (adapters are built on the served weights)"
        folder = pathlib.Path(path)
        if not (folder / "config.json").is_file():
            return f"{path} is not a checkpoint folder (no config.json)"
        start = time.perf_counter()
        try:
            diff = architecture_differences(self.config, ModelConfig.from_dir(folder))
            if diff:
                return f"{path} is not the served architecture ({'; '.join(diff[:4])})"
            self.staged = self._load(folder)
            self._staged_path = folder
        except Exception as exc:  # noqa: BLE001 - a bad checkpoint is the caller's error, said in its words
            log.warning("weights from %s refused: %s", path, exc)
            return f"{type(exc).__name__}: {exc}"
        log.info("weights from %s loaded beside the served ones in %.2f s", path, time.perf_counter() - start)
        return ""

    def swap(self, commit: bool) -> str:
        staged, self.staged = self.staged, None
        if not commit:
            return ""
        if staged is None:
            return "no weights were loaded to switch to"
        runner = self.runner
        staged.lora = runner.model.lora
        log.info("switching weights; decode steps: %s", staged.bind_kv_caches(runner.kv_caches))
        if runner.graphs is not None:
            from steploop.gpu_worker.cuda_graphs import DecodeGraphRunner
            graphs = DecodeGraphRunner(staged, runner.kv_caches, runner.block_size, runner.max_model_len)
            graphs.capture_all()
            runner.graphs = graphs
        runner.model = staged
        self.path = self._staged_path
        give_back_memory()            # the old model's tensors go now, and the heap pages they held
        return ""

    def drop(self) -> None:
        self.staged = None

    def reload(self):
        """The served weights again, from their folder (after sleep level 2 freed them)."""
        return self._load(self.path)


def control_op(runner, control: worker_pb2.EngineControl) -> Callable[[], object]:
    """The forward thread's work for one EngineControl message (run in order with the plans): its answer."""
    def run() -> worker_pb2.ControlResult:
        kind, updater, sleep = control.WhichOneof("op"), runner.weights, runner.sleep_mode
        if kind in ("weights_load", "weights_swap") and updater is None:
            error = "this worker cannot update its weights (it was built without a checkpoint loader)"
        elif kind in ("sleep", "wake_up") and sleep is None:
            error = "this worker has no sleep mode (it was built without a KV cache allocator)"
        elif kind == "weights_load":
            error = updater.load(control.weights_load.model_path)
        elif kind == "weights_swap":
            error = updater.swap(control.weights_swap.commit)
        elif kind == "sleep":
            error = sleep.sleep(control.sleep.level)
        elif kind == "wake_up":
            error = sleep.wake()
        elif kind in ("weights_group_join", "weights_receive"):
            from steploop.gpu_worker.weight_receiver import join_or_receive
            error = join_or_receive(runner, runner.receiver, control)
        else:
            error = f"unknown engine control operation {kind!r}"
        return worker_pb2.ControlResult(control_id=control.control_id, error=error, rss_bytes=rss_bytes())
    return run
