"""WeightSender: a training process pushes its weights into running steploop engines over a gloo group, without a
checkpoint on disk (SGLang's init_weights_update_group / update_weights_from_distributed, steploop's buckets):

    sender = WeightSender("http://gateway:8000", admin_key="...", master_address="10.0.0.5")
    sender.init_group(world_size=1 + worker_ranks)     # the trainer is rank 0; each worker rank joins
    sender.update(model.state_dict(), weight_version="step-7")   # every tensor, in buckets, each with its sha256

Each bucket is its tensors' bytes back to back, broadcast from rank 0 as one uint8 tensor, with its sha256 sent
beside it in the HTTP request; every worker rank checks it. A bucket that does not match (or a tensor of another
shape) refuses the whole update and the old weights keep serving. The HTTP call and the broadcasts run together:
the engine receives while the trainer sends. The gateway needs --admin-api-key. Imports torch (a trainer has it).
"""

from __future__ import annotations

import hashlib
import json
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_BUCKET_BYTES = 64 << 20


@dataclass
class Bucket:
    names: list[str]
    tensors: list[torch.Tensor]
    sha256: str

    def spec(self) -> dict:
        return {"tensors": [{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                            for n, t in zip(self.names, self.tensors)], "sha256": self.sha256}


def bucket_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The bucket as broadcast: each tensor's bytes (C order) back to back, one uint8 tensor."""
    return torch.cat([t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def sha256_hex(flat: torch.Tensor) -> str:
    return hashlib.sha256(flat.numpy().data).hexdigest()


def make_buckets(state_dict: dict[str, torch.Tensor], max_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    buckets: list[Bucket] = []
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    size = 0
    for name, tensor in state_dict.items():
        if tensors and size + tensor.numel() * tensor.element_size() > max_bytes:
            buckets.append(Bucket(names, tensors, sha256_hex(bucket_bytes(tensors))))
            names, tensors, size = [], [], 0
        names.append(name)
        tensors.append(tensor)
        size += tensor.numel() * tensor.element_size()
    if tensors:
        buckets.append(Bucket(names, tensors, sha256_hex(bucket_bytes(tensors))))
    return buckets


class WeightSender:
    def __init__(self, base_url: str, admin_key: str, master_address: str = "127.0.0.1", master_port: int = 0,
                 timeout_s: float = 60.0, group_name: str = "steploop-weights") -> None:
        self.base_url, self.admin_key = base_url.rstrip("/"), admin_key
        self.master_address, self.master_port = master_address, master_port
        self.timeout = timedelta(seconds=timeout_s)
        self.group_name = group_name
        self.group = None

    def _post(self, path: str, body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {self.admin_key}"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout.total_seconds() + 600) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")

    def _alongside(self, path: str, body: dict, work) -> tuple[int, dict]:
        """POSTs `body` in a thread while `work()` runs here (the engine joins / receives while we form / send)."""
        answer: dict = {}
        thread = threading.Thread(target=lambda: answer.update(r=self._post(path, body)), daemon=True)
        thread.start()
        try:
            work()
        finally:
            thread.join()
        return answer["r"]

    def init_group(self, world_size: int, rank_offset: int = 1) -> dict:
        """Forms the group: this process is rank 0; the engine's worker ranks join from rank_offset on."""
        store = dist.TCPStore(self.master_address, self.master_port, world_size, is_master=True,
                              timeout=self.timeout, wait_for_workers=False)
        body = {"master_address": self.master_address, "master_port": store.port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": self.group_name, "backend": "gloo",
                "timeout_s": self.timeout.total_seconds()}

        def form() -> None:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = self.timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.master_address)]
            self.group = dist.ProcessGroupGloo(dist.PrefixStore(self.group_name, store), 0, world_size, options)
        self._store = store
        status, answer = self._alongside("/init_weights_update_group", body, form)
        if status != 200:
            raise RuntimeError(f"init_weights_update_group: {status} {answer}")
        return answer

    def update(self, state_dict: dict[str, torch.Tensor] | None = None, weight_version: str = "",
               buckets: list[Bucket] | None = None) -> tuple[int, dict]:
        """Broadcasts every tensor (buckets: made from state_dict unless given); returns the HTTP (status, body)."""
        if self.group is None:
            raise RuntimeError("call init_group first")
        buckets = buckets if buckets is not None else make_buckets(state_dict)
        body = {"buckets": [b.spec() for b in buckets], "weight_version": weight_version,
                "group_name": self.group_name}

        def send() -> None:
            for bucket in buckets:
                options = dist.BroadcastOptions()
                options.rootRank = 0
                self.group.broadcast([bucket_bytes(bucket.tensors)], options).wait(self.timeout)
        return self._alongside("/update_weights_from_distributed", body, send)
