"""WeightReceiver: a worker rank's half of update_weights_from_distributed (the trainer's side is
steploop.weight_sync.WeightSender).

    join(group)       joins the trainer's gloo group as rank_offset + this worker's tensor-parallel rank (blocks
                      until every member joined, at most the group's timeout)
    receive(buckets)  takes every bucket's broadcast, checks its sha256, and stages the tensors as a checkpoint
                      folder (the served folder's config + one safetensors file, under the cache dir) that
                      WeightUpdater.load then loads and checks like any folder; the scheduler commits or drops it
                      on every rank (weight_update.py)

A bucket whose sha256 does not match is not used: every later bucket is still received (the trainer's broadcasts
must all complete), then the update is refused and the old weights keep serving.
"""

from __future__ import annotations

import logging
import math
import pathlib
import shutil
from datetime import timedelta

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from steploop.common.model_path import cache_dir
from steploop.common.pb.steploop.v1 import engine_pb2, worker_pb2
from steploop.weight_sync import DTYPES, sha256_hex

log = logging.getLogger(__name__)
DEFAULT_TIMEOUT_S = 60.0


class WeightReceiver:
    def __init__(self, runner, host: str) -> None:
        self.runner, self.host = runner, host
        self.group = None
        self.timeout = timedelta(seconds=DEFAULT_TIMEOUT_S)

    def join(self, request: engine_pb2.InitWeightsUpdateGroupRequest) -> str:
        if request.backend not in ("", "gloo"):
            return f"backend {request.backend!r}: this worker joins weight-update groups over gloo only"
        rank = request.rank_offset + self.runner.info.rank
        if not 0 < rank < request.world_size:
            return f"rank {rank} (rank_offset {request.rank_offset}) is not in 1..{request.world_size - 1}"
        self.timeout = timedelta(seconds=request.timeout_s or DEFAULT_TIMEOUT_S)
        try:
            store = dist.TCPStore(request.master_address, request.master_port, request.world_size, is_master=False,
                                  timeout=self.timeout)
            options = dist.ProcessGroupGloo._Options()
            options._timeout = self.timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
            self.group = dist.ProcessGroupGloo(dist.PrefixStore(request.group_name, store), rank,
                                               request.world_size, options)
        except Exception as exc:  # noqa: BLE001 - an unreachable trainer, a timeout: said to the caller
            self.group = None
            return f"joining the weight-update group at {request.master_address}:{request.master_port} failed: {exc}"
        log.info("joined weight-update group %r as rank %d of %d", request.group_name, rank, request.world_size)
        return ""

    def receive(self, buckets) -> str:
        if self.group is None:
            return "no weight-update group: POST /init_weights_update_group first"
        tensors: dict[str, torch.Tensor] = {}
        errors: list[str] = []
        for i, bucket in enumerate(buckets):
            specs = list(bucket.tensors)
            unknown = [s.dtype for s in specs if s.dtype not in DTYPES]
            sizes = [math.prod(s.shape) * (torch.empty((), dtype=DTYPES.get(s.dtype, torch.uint8)).element_size())
                     for s in specs]
            flat = torch.empty(sum(sizes), dtype=torch.uint8)
            options = dist.BroadcastOptions()
            options.rootRank = 0
            try:
                self.group.broadcast([flat], options).wait(self.timeout)
            except Exception as exc:  # noqa: BLE001 - the group is broken: leave it
                self.group = None
                return f"receiving bucket {i} failed ({exc}); the weight-update group is dropped, init it again"
            if unknown:
                errors.append(f"bucket {i}: dtype {unknown[0]!r} is not one of {', '.join(DTYPES)}")
            elif sha256_hex(flat) != bucket.sha256:
                errors.append(f"bucket {i} ({len(specs)} tensors from {specs[0].name if specs else '-'}): sha256 "
                              f"{sha256_hex(flat)[:16]}... does not match the sender's {bucket.sha256[:16]}...")
            else:
                offset = 0
                for spec, size in zip(specs, sizes):
                    tensors[spec.name] = flat[offset:offset + size].view(DTYPES[spec.dtype]).reshape(
                        tuple(spec.shape)).clone()
                    offset += size
        if errors:
            return f"{len(errors)} of {len(buckets)} buckets refused: {errors[0]}"
        return self.runner.weights.load(str(self._stage(tensors)))

    def _stage(self, tensors: dict[str, torch.Tensor]) -> pathlib.Path:
        """The received tensors as a checkpoint folder (kept until the next update: sleep level 2 reloads it)."""
        folder = cache_dir() / "weight-updates" / self.runner.info.worker_id.replace(":", "-").replace("/", "-")
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        served = self.runner.weights.path
        for name in ("config.json", "generation_config.json"):
            if served is not None and (served / name).is_file():
                shutil.copy(served / name, folder / name)
        save_file(tensors, str(folder / "model.safetensors"))
        return folder


def join_or_receive(runner, receiver: WeightReceiver | None, control: worker_pb2.EngineControl) -> str:
    if receiver is None or runner.weights is None:
        return "this worker cannot receive weights (it was built without a checkpoint loader)"
    if control.HasField("weights_group_join"):
        return receiver.join(control.weights_group_join.group)
    return receiver.receive(control.weights_receive.buckets)
