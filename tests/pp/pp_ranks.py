"""A tp x pp group of ModelRunners, one thread per rank in one process, over real gloo groups on loopback
(form_stage_groups), driven as the scheduler drives a group: every rank executes the same plan, the answering
rank's result (the last stage's tp rank 0) is what the test driver sees, and every other rank must agree it
kept up (no error)."""

from __future__ import annotations

import collections
import pathlib
import queue
import threading
import time
from datetime import timedelta

import torch

STOP = object()


class PipelineGroup:
    """Quacks like a ModelRunner for tests/worker/driver.py: execute(plan) runs the plan on every rank."""

    def __init__(self, model_dir: pathlib.Path, tp: int, pp: int, timeout: float = 120.0, **config):
        from steploop.gpu_worker.config import WorkerConfig
        from steploop.gpu_worker.distributed.process_group import GroupStore

        self.world = tp * pp
        self.store = GroupStore("127.0.0.1", self.world)
        self.inboxes = [queue.Queue() for _ in range(self.world)]
        self.outbox: queue.Queue = queue.Queue()
        self.runners: list = [None] * self.world
        self.timeout = timeout
        self._early = [collections.deque() for _ in range(self.world)]   # answers taken, per rank (collect)
        self.spans: list[tuple[int, int, float, float]] = []   # (rank, step id, began, ended) of submitted plans
        kwargs = {"model": str(model_dir), "num_kv_blocks": 64, "max_model_len": 256, "device": "cpu",
                  "dtype": "float32", "num_threads": 1, **config, "tensor_parallel_size": tp,
                  "pipeline_parallel_size": pp}
        self.configs = [WorkerConfig(rank=r, **kwargs) for r in range(self.world)]
        self.threads = [threading.Thread(target=self._rank_main, args=(r,), daemon=True) for r in range(self.world)]
        for t in self.threads:
            t.start()
        ready = [self._take() for _ in range(self.world)]
        errors = [e for _, e in ready if isinstance(e, BaseException)]
        if errors:
            self.close()
            raise errors[0]
        self.answer = self.runners[0].info.answer_rank
        self.block_size = self.runners[0].block_size
        self.info = self.runners[self.answer].info

    def _rank_main(self, rank: int) -> None:
        from steploop.gpu_worker.distributed.process_group import form_stage_groups
        from steploop.gpu_worker.model_runner import ModelRunner

        config = self.configs[rank]
        try:
            runner = ModelRunner.from_config(config, pathlib.Path(config.model))
            timeout = timedelta(seconds=self.timeout)
            tp_group, whole = form_stage_groups(rank, config.tensor_parallel_size, config.pipeline_parallel_size,
                                                self.store.address, 1, timeout, "127.0.0.1", torch.device("cpu"),
                                                self.store if rank == 0 else None)
            if tp_group is not None:
                runner.tp_comm.attach(tp_group, 1, timeout)
            runner.pipe.attach(whole, 1, timeout)
            self.runners[rank] = runner
            self.outbox.put((rank, None))
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            self.outbox.put((rank, exc))
            return
        while (job := self.inboxes[rank].get()) is not STOP:
            try:
                self.outbox.put((rank, job(runner)))
            except BaseException as exc:  # noqa: BLE001 - a CollectiveError: the group broke
                self.outbox.put((rank, exc))

    def _take(self):
        try:
            return self.outbox.get(timeout=self.timeout + 60)
        except queue.Empty:
            raise AssertionError("a rank answered nothing: the group hangs") from None

    def run_all(self, job, ranks=None) -> dict:
        ranks = range(self.world) if ranks is None else ranks
        for r in ranks:
            self.inboxes[r].put(job)
        answers = dict(self._take() for _ in ranks)
        return answers

    def execute(self, plan):
        answers = self.run_all(lambda runner: runner.execute(plan))
        for rank, answer in answers.items():
            if isinstance(answer, BaseException):
                raise answer
            assert not answer.error, f"rank {rank}: {answer.error}"
        for rank, answer in answers.items():      # the last stage's tp ranks sample the same; the others none
            assert answer.sampled in ({}, answers[self.answer].sampled), f"rank {rank} sampled other tokens"
        return answers[self.answer]

    def submit(self, plan) -> None:
        """Queues the plan on every rank without waiting. A rank runs its plans in order, so with two submitted the
        first stage runs the second while the last stage still runs the first, as under the scheduler's window."""
        def job(runner, rank):
            began = time.perf_counter()
            result = runner.execute(plan)
            self.spans.append((rank, plan.step_id, began, time.perf_counter()))
            return result
        for rank, inbox in enumerate(self.inboxes):
            inbox.put(lambda runner, rank=rank: job(runner, rank))

    def collect(self, plan):
        """The answering rank's result of `plan`, the oldest plan submitted and not collected (every rank answers
        its plans in order; the others' answers must be error-free)."""
        while any(not self._early[r] for r in range(self.world)):
            rank, answer = self._take()
            self._early[rank].append(answer)
        answers = {r: self._early[r].popleft() for r in range(self.world)}
        for rank, answer in answers.items():
            if isinstance(answer, BaseException):
                raise answer
            assert answer.step_id == plan.step_id and not answer.error, f"rank {rank}: {answer}"
        return answers[self.answer]

    def reset(self) -> None:
        self.run_all(lambda runner: runner.reset())

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(STOP)
        for t in self.threads:
            t.join(30)
