"""One host-to-device copy per step: every per-step array is packed into one host buffer and sent at once.

    staging = StagingBuffer(device)             # once, in the ModelRunner
    step = staging.begin()                      # per step
    ids = step.put(np_array)                    # any number of arrays (int32/int64/float32/bool), a slot each
    step.send()                                 # ONE copy host -> device (non_blocking from pinned memory on CUDA)
    step.get(ids)                               # the array as a view of the device buffer (same dtype and shape)

Layout of the buffer (each array starts on a 64-byte boundary, so a byte slice can be viewed as any dtype):

    | input ids | positions | slots | query_start_loc | seq_lens | ... | block-table diffs | sampling params |

The host side is pinned when CUDA is available (an unpinned copy is staged by the driver through its own bounce
buffer and waits for the GPU); there are two host buffers used in turn, and on CUDA an event recorded after each
copy guards a buffer's reuse, so packing step N+1 never overwrites bytes step N's copy has not read yet. The device
buffer is one persistent tensor: step N+1's copy lands after step N's kernels on the same stream.

On the CPU (direct=True, the default there) host memory is the device's: put() keeps a tensor over the array and
send() copies nothing, which spares the packing (~0.1 ms a step, ~1% of a one-request CPU decode step). Tests that
instrument the GPU's route on the CPU pass direct=False.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

ALIGN = 64
_TORCH_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64,
                 np.dtype(np.float32): torch.float32, np.dtype(np.bool_): torch.bool, np.dtype(np.uint8): torch.uint8}


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _host_bytes(nbytes: int, pin: bool) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


@dataclass
class _Slot:
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class StepStaging:
    """One step's packing: put arrays, send once, read device views."""
    owner: StagingBuffer
    host: torch.Tensor                    # [capacity] uint8, the host buffer this step packs into
    host_np: np.ndarray                   # the same memory as numpy (made once: .numpy() per put costs)
    slots: list[_Slot] = field(default_factory=list)
    direct: list[torch.Tensor] = field(default_factory=list)   # direct mode: the arrays as tensors, by slot
    used: int = 0
    sent: bool = False

    def put(self, array: np.ndarray) -> int:
        """Copy `array` into the host buffer (growing it if needed); returns its slot id for get()."""
        if self.sent:
            raise RuntimeError("put after send: the step's arrays went to the device already")
        array = np.ascontiguousarray(array)
        dtype = _TORCH_DTYPES.get(array.dtype)
        if dtype is None:
            raise TypeError(f"cannot stage dtype {array.dtype}; use int32, int64, float32, bool or uint8")
        if self.owner.direct:                 # CPU: the array is already where the step reads it
            self.direct.append(torch.from_numpy(array))
            return len(self.direct) - 1
        offset = _align(self.used)
        end = offset + array.nbytes
        if end > self.host.numel():
            self.host, self.host_np = self.owner._grow_host(self.host_np, end, self.used)
        if array.nbytes:
            self.host_np[offset:end] = array.reshape(-1).view(np.uint8)
        self.slots.append(_Slot(offset, array.nbytes, dtype, array.shape))
        self.used = end
        return len(self.slots) - 1

    def send(self) -> None:
        """The step's one host-to-device copy (asynchronous from pinned memory on CUDA)."""
        self.owner._send(self)
        self.sent = True

    def get(self, slot: int) -> torch.Tensor:
        """The array put under `slot`, as a view of the device buffer (valid until the next step's send)."""
        if not self.sent:
            raise RuntimeError("get before send")
        if self.owner.direct:
            return self.direct[slot]
        s = self.slots[slot]
        return self.owner.device_buf[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)


class StagingBuffer:
    def __init__(self, device: torch.device | str, capacity: int = 1 << 16, direct: bool | None = None):
        self.device = torch.device(device)
        self.direct = self.device.type == "cpu" if direct is None else direct
        if self.direct and self.device.type != "cpu":
            raise ValueError("direct staging (no copy) is for the CPU only")
        self.pin = self.device.type == "cuda" and torch.cuda.is_available()
        self.hosts = [_host_bytes(capacity, self.pin) for _ in range(2)]
        self.hosts_np = [h.numpy() for h in self.hosts]
        self.events: list[object | None] = [None, None]
        self.device_buf = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        self.turn = 0
        self.num_grows = 0

    def begin(self) -> StepStaging:
        self.turn ^= 1
        event = self.events[self.turn]
        if event is not None:
            event.synchronize()      # that buffer's last copy has been read (long done in steady state)
        return StepStaging(self, self.hosts[self.turn], self.hosts_np[self.turn])

    def _grow_host(self, host_np: np.ndarray, need: int, used: int) -> tuple[torch.Tensor, np.ndarray]:
        """A larger host buffer (x2 until it fits) holding what this step packed so far; rare (the first big step)."""
        size = len(host_np)
        while size < need:
            size *= 2
        bigger = _host_bytes(size, self.pin)
        bigger_np = bigger.numpy()
        bigger_np[:used] = host_np[:used]
        self.hosts[self.turn], self.hosts_np[self.turn] = bigger, bigger_np
        self.num_grows += 1
        return bigger, bigger_np

    def _send(self, step: StepStaging) -> None:
        if self.direct:
            return
        if step.used > self.device_buf.numel():
            self.device_buf = torch.empty(step.host.numel(), dtype=torch.uint8, device=self.device)
        if step.used:
            self.device_buf[:step.used].copy_(step.host[:step.used], non_blocking=self.pin)
        if self.pin:
            event = torch.cuda.Event()
            event.record()
            self.events[self.turn] = event
