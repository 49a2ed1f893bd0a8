"""KvEventsConfig: `--kv-events-config` JSON, vLLM's fields in vLLM's order (vllm/config/kv_events.py
KVEventsConfig, vLLM 0.32.0), so one deployment's JSON serves both engines:

    {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
     "replay_endpoint": "tcp://*:5558", "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000, "topic": ""}

Events on with publisher "null" feed only Engine.WatchKVEvents (gRPC, which the gateway's router reads); "zmq"
adds vLLM's PUB/ROUTER sockets and needs the optional extra steploop[kv-events] (pyzmq, msgspec).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass


class KvEventsConfigError(ValueError):
    """The --kv-events-config value cannot run; the message says why and how to fix it."""


@dataclass(frozen=True)
class KvEventsConfig:
    # Record prefix-cache changes as BlockStored / BlockRemoved / AllBlocksCleared per step.
    enable_kv_cache_events: bool = False
    # "zmq" or "null"; unset: "zmq" when events are on (vLLM's __post_init__), else "null".
    publisher: str | None = None
    # The PUB socket: a wildcard (tcp://*:5557), ipc:// or inproc:// address binds, any other connects.
    endpoint: str = "tcp://*:5557"
    # The ROUTER socket answering replay requests (an 8-byte big-endian start sequence); None = no replay.
    replay_endpoint: str | None = None
    # Batches (steps) kept for replay, on ZMQ and for WatchKVEvents reconnects.
    buffer_steps: int = 10_000
    # ZMQ high-water mark of the PUB socket: past it, a slow subscriber's messages are dropped.
    hwm: int = 100_000
    # Batches queued for the publisher thread at most (the step loop never blocks on it: past it, it drops).
    max_queue_size: int = 100_000
    # The first frame of every message; subscribers filter on it.
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise KvEventsConfigError(f"--kv-events-config publisher={self.publisher!r}: use \"zmq\" or \"null\"")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise KvEventsConfigError(f"--kv-events-config {name}={getattr(self, name)} must be >= 1")

    @property
    def zmq(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str | None) -> KvEventsConfig:
        if not text:
            return cls()
        try:
            values = json.loads(text)
        except json.JSONDecodeError as err:
            raise KvEventsConfigError(f"--kv-events-config is not JSON ({err}): {text!r}") from None
        if not isinstance(values, dict):
            raise KvEventsConfigError(f"--kv-events-config must be a JSON object, got {text!r}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise KvEventsConfigError(f"--kv-events-config: unknown field(s) {', '.join(unknown)}; "
                                      f"known: {', '.join(known)}")
        config = cls(**values)
        if config.zmq:
            require_zmq()
        return config


def require_zmq() -> None:
    """Fail at start-up, with the fix, when the ZMQ publisher's optional packages are missing."""
    missing = []
    for module in ("zmq", "msgspec"):
        try:
            __import__(module)
        except ImportError:
            missing.append({"zmq": "pyzmq"}.get(module, module))
    if missing:
        raise KvEventsConfigError(f"--kv-events-config publisher \"zmq\" needs {' and '.join(missing)}: "
                                  "pip install 'steploop[kv-events]' (or use \"publisher\": \"null\" for the "
                                  "gRPC WatchKVEvents stream only)")
