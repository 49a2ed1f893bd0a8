"""The worker process: load the model, then attach to the scheduler's plan stream and serve steps forever.

    connect -> Attach: send hello(WorkerInfo) -> for each plan: execute (one forward thread) -> send result
       ^                                                                                       |
       └──── stream broke or scheduler not up: reset the persistent batch, back off 0.2 s .. 2 s ┘

The forward runs in a single-thread executor, so the event loop keeps answering gRPC keepalives during a long
step, and reads the next plan and writes the last result meanwhile. Breaking the stream makes the scheduler
preempt everything this worker held, so the worker forgets it all.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import signal
import sys
import threading
import time

import grpc

from steploop.common import event_loop, grpc_options, observability
from steploop.common.metrics import MetricsServer
from steploop.common.model_path import (
    DEFAULT_MODEL,
    default_model_dir,
    gguf_model_dir,
    is_gguf,
    is_model_dir,
    resolve_model,
)
from steploop.common.pb.steploop.v1 import worker_pb2, worker_pb2_grpc
from steploop.common.step_contract import SCHEDULER_STOPPING_METADATA, StepPlan
from steploop.common.tls import open_channel
from steploop.gpu_worker.config import WorkerConfig, add_cli_args
from steploop.gpu_worker.distributed.comm import CollectiveError
from steploop.gpu_worker.distributed.rank_link import RankLink
from steploop.gpu_worker.metrics import WorkerObserver, make_observer
from steploop.gpu_worker.model_runner import ModelRunner
from steploop.gpu_worker.weight_update import control_op

log = logging.getLogger("steploop.worker")

CHANNEL_OPTIONS = grpc_options.CLIENT
BACKOFF_START_S, BACKOFF_MAX_S = 0.2, 2.0


def model_path_for(config: WorkerConfig):
    """The model folder; the default model is converted from its GGUF on first use."""
    if (not config.model or config.model == DEFAULT_MODEL) and not is_model_dir(default_model_dir()):
        from steploop.gpu_worker.gguf_convert import convert_default_model
        log.info("default model not converted yet; converting it now")
        convert_default_model()
    if is_gguf(config.model) and not is_model_dir(gguf_model_dir(config.model)):
        from steploop.gpu_worker.gguf_convert import convert_gguf
        convert_gguf(config.model)
    return resolve_model(config.model)


async def serve(config: WorkerConfig, runner: ModelRunner | None = None,
                stop: asyncio.Event | None = None, metrics_port: int = 0) -> None:
    """Serve plans until `stop` is set (SIGTERM/SIGINT set it when run from main)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
    metrics_server = None
    try:
        if runner is None:
            runner = await loop.run_in_executor(executor, ModelRunner.from_config, config, model_path_for(config))
        obs = make_observer(runner.info)
        if metrics_port:
            metrics_server = await MetricsServer(obs.registry, "worker").start("0.0.0.0", metrics_port)
        await _attach_forever(config, runner, executor, stop, obs)
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
        if metrics_server is not None:
            await metrics_server.stop()


async def _attach_forever(config: WorkerConfig, runner: ModelRunner, executor, stop: asyncio.Event,
                          obs: WorkerObserver) -> None:
    backoff, waiting_logged = BACKOFF_START_S, False
    while not stop.is_set():
        served = await _attach_once(config, runner, executor, stop, obs)
        runner.reset()
        obs.reset()
        if not served and not waiting_logged:
            log.info("scheduler %s not reachable yet; retrying every %.1f-%.1f s", config.scheduler_address,
                     BACKOFF_START_S, BACKOFF_MAX_S)
        waiting_logged = not served
        if stop.is_set():
            break
        backoff = BACKOFF_START_S if served else min(backoff * 2, BACKOFF_MAX_S)
        try:
            await asyncio.wait_for(stop.wait(), timeout=backoff)
        except asyncio.TimeoutError:
            pass


async def _attach_once(config: WorkerConfig, runner: ModelRunner, executor, stop: asyncio.Event,
                       obs: WorkerObserver) -> bool:
    """One attach: returns whether it got attached (then the next reconnect starts from a short backoff)."""
    served = stopped = False
    async with open_channel(config.scheduler_address, config.tls, CHANNEL_OPTIONS) as channel:
        call = worker_pb2_grpc.PlanStreamStub(channel).Attach()
        stopper = asyncio.ensure_future(stop.wait())
        rank = RankLink(config, runner)       # this attach's place in a tensor-parallel group (if any)
        try:
            await call.write(worker_pb2.WorkerMessage(hello=rank.hello().to_pb()))
            served = True
            log.info("attached to scheduler %s as %s (%d KV blocks of %d tokens)", config.scheduler_address,
                     runner.info.worker_id, runner.info.num_kv_blocks, runner.info.block_size)
            stopped = await _serve_stream(call, runner, executor, stopper, obs, config.scheduler_address, rank)
        except grpc.aio.AioRpcError as err:
            level = logging.WARNING if served else logging.DEBUG
            log.log(level, "plan stream to %s ended: %s %s", config.scheduler_address, err.code().name,
                    err.details())
        except CollectiveError as err:        # the group broke: leave it and re-attach; the scheduler re-forms it
            log.warning("tensor-parallel group broke: %s", err)
            call.cancel()
        finally:
            stopper.cancel()
            rank.leave()
    if served and not stopped:            # a stopping scheduler's end was logged as such, once
        log.info("detached from scheduler %s; forgetting all requests", config.scheduler_address)
    return served


async def _serve_stream(call, runner: ModelRunner, executor, stopper: asyncio.Future, obs: WorkerObserver,
                        address: str, rank: RankLink) -> bool:
    """Serve the stream's plans until it ends (EOF), breaks (raises AioRpcError) or `stopper` fires. Returns
    whether the scheduler ended it because it is stopping.

    The forward thread runs one loop for the whole stream: it takes the next plan from a queue that the event loop
    fills as plans arrive (decoded while the previous step runs; the scheduler keeps two outstanding) and hands each
    result to the writer. So between two forwards it waits on nothing: not on the result's write, the next read or
    an event-loop round trip, which had cost ~2.5 ms a step (of ~130 ms at 64 requests) on a busy 2-core host.
    """
    loop = asyncio.get_running_loop()
    plans: queue.SimpleQueue = queue.SimpleQueue()  # StepPlan, a group-forming callable, _Ready, or None to end
    results: asyncio.Queue = asyncio.Queue()       # (True, StepResult) or (False, an engine control's answer)
    waiter = _ReadyWaiter(plans)

    def emit(step_results) -> None:
        for result in step_results:
            loop.call_soon_threadsafe(results.put_nowait, (True, result))

    submit, drain, in_flight = _stepping(runner)

    def forward_loop() -> None:
        # One step stays in flight on a GPU (step_overlap.py): plan N+1 is launched before step N is finished,
        # and step N is finished when plan N+1 comes or when the GPU is done with it, whichever is first.
        while (plan := plans.get()) is not None:
            if isinstance(plan, _Ready):           # the step in flight is done on the device
                if in_flight() is plan.step:
                    emit(drain())
                continue
            if callable(plan):                     # form the group, or an engine control (weight_update.py),
                emit(drain())                      # in order with the plans, on a worker with no step in flight
                answer = plan()
                if answer is not None:
                    loop.call_soon_threadsafe(results.put_nowait, (False, answer))
                continue
            emit(submit(plan))                     # a failed step comes back as an error result; a broken
            if in_flight() is not None:            # group raises CollectiveError
                waiter.watch(in_flight())

    async def write_results() -> None:
        while True:
            is_step, result = await results.get()
            if not is_step:                        # an engine control's answer
                await call.write(worker_pb2.WorkerMessage(control_result=result))
                continue
            await call.write(worker_pb2.WorkerMessage(result=rank.answer(result).to_pb()))
            plan = sent.pop(result.step_id, None)
            if plan is not None:
                obs.after(plan, result)

    sent: dict[int, StepPlan] = {}                 # step id -> its plan, until its result is written
    forward = asyncio.ensure_future(loop.run_in_executor(executor, forward_loop))
    writer = asyncio.ensure_future(write_results())
    try:
        while True:
            reader = asyncio.ensure_future(call.read())
            done, _ = await asyncio.wait({reader, stopper, writer, forward}, return_when=asyncio.FIRST_COMPLETED)
            for task in (writer, forward):
                if task in done:
                    reader.cancel()
                    task.result()                  # the write failed (stream broken) or the forward thread died
                    raise RuntimeError("the forward loop ended on its own")
            if reader not in done:                 # stopping
                reader.cancel()
                call.cancel()
                return False
            msg = reader.result()
            if msg is grpc.aio.EOF:
                stopping = _scheduler_stopping(await call.trailing_metadata())
                log.log(logging.INFO if stopping else logging.WARNING, "scheduler %s %s the plan stream; "
                        "forgetting all requests", address, "is stopping: it ended" if stopping else "closed")
                return stopping
            if msg.HasField("plan"):
                plan = StepPlan.from_pb(msg.plan)
                obs.before(plan)
                sent[plan.step_id] = plan
                plans.put(plan)
            elif msg.HasField("tp_group"):
                plans.put(rank.former(msg.tp_group))
            elif msg.HasField("control"):
                plans.put(control_op(runner, msg.control))
    finally:
        plans.put(None)                            # the forward thread ends after the step it is on
        waiter.close()
        writer.cancel()
        await asyncio.gather(forward, writer, return_exceptions=True)


def _stepping(runner):
    """(submit(plan) -> results, drain() -> results, in_flight() -> the step in flight or None): the runner's own
    where it can keep a step in flight (ModelRunner), else one execute(plan) per plan and never a step in flight (a
    runner with only execute and reset: test fakes, benchmarks/paced_worker.py)."""
    if hasattr(runner, "submit"):
        return runner.submit, runner.drain, lambda: runner.in_flight
    return (lambda plan: [runner.execute(plan)]), list, lambda: None


@dataclasses.dataclass
class _Ready:
    """In the plan queue: the step in flight has finished on the device (its result can be read without waiting)."""
    step: object


class _ReadyWaiter:
    """A thread that waits for each in-flight step's device work and then queues _Ready for it, so the forward
    loop wakes for whichever comes first: the next plan, or the end of the step in flight."""

    def __init__(self, plans: queue.SimpleQueue) -> None:
        self.plans = plans
        self.steps: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="step-ready", daemon=True)
        self.thread.start()

    def watch(self, step) -> None:
        self.steps.put(step)

    def close(self) -> None:
        self.steps.put(None)

    def _run(self) -> None:
        while (step := self.steps.get()) is not None:
            if step.event is not None:
                step.event.synchronize()     # releases the GIL while it waits
            self.plans.put(_Ready(step))


def _scheduler_stopping(trailing) -> bool:
    """Whether the scheduler ended the plan stream because it is stopping (an ordered stop, logged as such)."""
    key, value = SCHEDULER_STOPPING_METADATA
    if trailing is None:
        return False
    return (trailing.get(key) if hasattr(trailing, "get") else dict(trailing).get(key)) == value   # Metadata or pairs


def build_parser() -> argparse.ArgumentParser:
    parser = add_cli_args(argparse.ArgumentParser(prog="steploop worker",
                                                  description="steploop gpu_worker: runs the model for a scheduler"))
    observability.add_cli_args(parser)
    observability.add_worker_metrics_arg(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    observability.setup("worker", args)
    try:
        config = WorkerConfig.from_args(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return event_loop.run(_main(config, args.worker_metrics_port))


async def _main(config: WorkerConfig, metrics_port: int = 0) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    start = time.perf_counter()
    try:
        await serve(config, stop=stop, metrics_port=metrics_port)
    except (ValueError, FileNotFoundError) as err:   # a configuration that cannot work (too few KV blocks,
        log.error("%s", err)                           # no model folder): exit 2, so a supervisor does not
        return 2                                       # restart it in a loop
    log.info("worker stopped after %.0f s", time.perf_counter() - start)
    return 0
