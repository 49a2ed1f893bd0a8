"""The engine-control seam (pause, resume, weight updates): the modes and the state both sides speak, mirroring
steploop.v1.PauseRequest / EngineControlState (engine.proto). Only the servicer and the engine client convert."""

from __future__ import annotations

from dataclasses import dataclass

from steploop.common.pb.steploop.v1 import engine_pb2

# vLLM's /pause modes, in PauseMode's wire order.
PAUSE_MODES = ("abort", "wait", "keep")


@dataclass(frozen=True)
class ControlState:
    paused: bool = False
    weight_version: str = "0"        # the served weights' version ("0": as loaded at start)
    weight_updates: int = 0          # updates applied since start
    num_aborted: int = 0             # by this Pause (abort mode)
    num_preempted: int = 0           # by this Pause (keep mode) or weight update
    sleep_level: int = 0             # 0 awake; 1 KV cache freed; 2 weights freed too
    worker_rss_bytes: tuple[int, ...] = ()   # Sleep / WakeUp: each rank's resident memory after it
    weights_staged: bool = False     # an update staged with stage_only awaits SwitchWeights
    # The gateway's router only (not on the wire): each replica's own answer, in replica order.
    replicas: tuple[ReplicaControl, ...] = ()

    def to_pb(self) -> engine_pb2.EngineControlState:
        return engine_pb2.EngineControlState(paused=self.paused, weight_version=self.weight_version,
                                             weight_updates=self.weight_updates, num_aborted=self.num_aborted,
                                             num_preempted=self.num_preempted, sleep_level=self.sleep_level,
                                             worker_rss_bytes=list(self.worker_rss_bytes),
                                             weights_staged=self.weights_staged)

    @classmethod
    def from_pb(cls, pb: engine_pb2.EngineControlState) -> ControlState:
        return cls(paused=pb.paused, weight_version=pb.weight_version or "0", weight_updates=pb.weight_updates,
                   num_aborted=pb.num_aborted, num_preempted=pb.num_preempted, sleep_level=pb.sleep_level,
                   worker_rss_bytes=tuple(pb.worker_rss_bytes), weights_staged=pb.weights_staged)


@dataclass(frozen=True)
class ReplicaControl:
    """One scheduler replica's part of a control call made through the gateway's router."""
    address: str
    state: ControlState | None       # its answer; None when it failed
    error: str = ""                  # why it failed
    fenced: str = ""                 # set: the router sends it no requests, and why (weights differ, still paused)
