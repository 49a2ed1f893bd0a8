"""ControlFanout: engine control (pause, resume, sleep, weight updates) over every scheduler replica the router
knows, so that the deployment changes state as one:

- pause / sleep: all replicas or none. When one refuses (or is unreachable), those that paused are resumed (woken)
  again and the call fails naming the replica; requests already aborted by an abort-mode pause stay aborted.
- weight updates: two phases across replicas. Every replica stages the checkpoint beside its served weights
  (stage_only); if any refuses, every staged copy is dropped and nothing switched anywhere. Then every replica
  commits, at one version (the caller's, or one more than the highest update count). A replica whose commit fails
  (its worker group lost meanwhile) is fenced: the router sends it no requests while its version differs from the
  others', so no client is served by mixed weights; a later update, or /get_weight_version finding it at the
  deployment's version, lifts the fence (and fences a replica it finds at another version).
- resume / wake_up: a replica that cannot is fenced (it would hold requests) until the same call reaches it.

Every answer lists each replica's own state (ControlState.replicas), so a caller sees a split.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from steploop.common.engine_control import ControlState, ReplicaControl
from steploop.gateway import errors
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.routing.replica import Replica

logger = logging.getLogger(__name__)


class ControlFanout:
    def __init__(self, live: Callable[[], list[Replica]]) -> None:
        self._live = live
        self.weight_version: str | None = None   # the version every unfenced replica serves, once an update ran

    def _targets(self) -> list[Replica]:
        live = self._live()
        if not live:
            raise errors.engine_unavailable("no scheduler replica is known yet (discovery found none)")
        return live

    async def _call(self, replicas: Sequence[Replica], call: str, *args) -> list[ControlState | BaseException]:
        return await asyncio.gather(*(getattr(r.client, call)(*args) for r in replicas), return_exceptions=True)

    # ---- all or none ------------------------------------------------------------------------------------------
    async def all_or_none(self, call: str, undo: str, *args) -> ControlState:
        """`call` on every replica; if any fails, `undo` on those where it succeeded, then the failure."""
        replicas = self._targets()
        results = await self._call(replicas, call, *args)
        failed = [(r, e) for r, e in zip(replicas, results) if isinstance(e, BaseException)]
        if not failed:
            return self.merged(replicas, results)
        done = [r for r, e in zip(replicas, results) if not isinstance(e, BaseException)]
        undone = await self._call(done, undo)
        stuck = [r.address for r, e in zip(done, undone) if isinstance(e, BaseException)]
        note = (f"{undo} on the {len(done)} replica(s) where it succeeded" if not stuck else
                f"{undo} failed on {', '.join(stuck)} too: call {undo} again")
        raise _failure(f"{call}", failed, len(replicas), f"nothing changed ({note})")

    async def reach_all(self, call: str) -> ControlState:
        """resume / wake_up on every replica; one that fails is fenced (it would hold requests) until the same call
        reaches it. Fails only when no replica answered."""
        replicas, what = self._targets(), f"it did not {call.replace('_', ' ')}"
        results = await self._call(replicas, call)
        for replica, result in zip(replicas, results):
            if isinstance(result, BaseException):
                replica.fenced = f"{what} ({_message(result)}); POST /{call} again"
                logger.warning("scheduler %s: %s: fenced", replica.address, replica.fenced)
            elif replica.fenced.startswith(what):
                replica.fenced = ""
        if all(isinstance(r, BaseException) for r in results):
            raise _failure(call, list(zip(replicas, results)), len(replicas), "the engine stays paused")
        return self.merged(replicas, results)

    async def state(self) -> ControlState:
        """Every replica's state. Once an update set the deployment's version, a replica found at another one (its
        worker restarted from weights no folder holds) is fenced, and a fenced one found at it is routed to again."""
        replicas = self._targets()
        results = await self._call(replicas, "control_state")
        for replica, result in zip(replicas, results):
            if isinstance(result, BaseException) or self.weight_version is None:
                continue
            if result.weight_version != self.weight_version and not replica.fenced:
                replica.fenced = (f"weights at version {result.weight_version}, not the deployment's "
                                  f"{self.weight_version}: it gets no requests until an update reaches it")
                logger.error("scheduler %s: %s", replica.address, replica.fenced)
            elif replica.fenced.startswith("weights") and result.weight_version == self.weight_version:
                replica.fenced = ""
                logger.info("scheduler %s serves weight version %s again: unfenced", replica.address,
                            self.weight_version)
        if all(isinstance(r, BaseException) for r in results):
            raise next(r for r in results if isinstance(r, BaseException))
        return self.merged(replicas, results)

    # ---- weight updates ---------------------------------------------------------------------------------------
    async def update_weights(self, stage: Callable[[EngineClient], Awaitable[ControlState]],
                             version: str) -> ControlState:
        """`stage` (an update with stage_only) on every replica at once, then commit on all at one version (or drop
        on all when any refused)."""
        replicas = self._targets()
        staged = await asyncio.gather(*(stage(r.client) for r in replicas), return_exceptions=True)
        failed = [(r, e) for r, e in zip(replicas, staged) if isinstance(e, BaseException)]
        if failed:
            ok = [r for r, e in zip(replicas, staged) if not isinstance(e, BaseException)]
            await self._call(ok, "switch_weights", False)
            raise _failure("the weight update", failed, len(replicas),
                           "no replica switched: the old weights keep serving everywhere")
        version = version or str(max(s.weight_updates for s in staged) + 1)
        committed = await self._call(replicas, "switch_weights", True, version)
        failed = [(r, e) for r, e in zip(replicas, committed) if isinstance(e, BaseException)]
        if len(failed) == len(replicas):
            raise _failure("the weight switch", failed, len(replicas), "no replica switched")
        self.weight_version = version
        for replica, result in zip(replicas, committed):
            if isinstance(result, BaseException):
                replica.fenced = (f"weights not switched to version {version} ({_message(result)}): it gets no "
                                  "requests until an update reaches it")
                logger.error("scheduler %s did not switch to weight version %s: fenced", replica.address, version)
            elif replica.fenced.startswith("weights"):
                replica.fenced = ""
        if failed:
            raise errors.APIError(503, f"weight version {version} serves on {len(replicas) - len(failed)} of "
                                  f"{len(replicas)} replicas; {_listed(failed)} did not switch and get no requests "
                                  "until an update reaches them (send the update again)", type="server_error",
                                  code="weights_diverged")
        return self.merged(replicas, committed)

    # ---- answers ----------------------------------------------------------------------------------------------
    def merged(self, replicas: Sequence[Replica], results: Sequence[ControlState | BaseException]) -> ControlState:
        """The replicas' states as one: paused if any is, counts summed, the version when all agree (else each
        replica's, comma-separated), and each replica's own answer."""
        states = [s for s in results if not isinstance(s, BaseException)]
        versions = list(dict.fromkeys(s.weight_version for s in states))
        per_replica = tuple(ReplicaControl(r.address, None if isinstance(s, BaseException) else s,
                                           _message(s) if isinstance(s, BaseException) else "", r.fenced)
                            for r, s in zip(replicas, results))
        return ControlState(paused=any(s.paused for s in states), weight_version=",".join(versions),
                            weight_updates=min(s.weight_updates for s in states),
                            num_aborted=sum(s.num_aborted for s in states),
                            num_preempted=sum(s.num_preempted for s in states),
                            sleep_level=max(s.sleep_level for s in states),
                            worker_rss_bytes=tuple(r for s in states for r in s.worker_rss_bytes),
                            weights_staged=any(s.weights_staged for s in states), replicas=per_replica)


def _message(exc: BaseException) -> str:
    return exc.message if isinstance(exc, errors.APIError) else f"{type(exc).__name__}: {exc}"


def _listed(failed: Sequence[tuple[Replica, BaseException]]) -> str:
    return "; ".join(f"{r.address}: {_message(e)}" for r, e in failed)


def _failure(what: str, failed: Sequence[tuple[Replica, BaseException]], total: int, outcome: str) -> errors.APIError:
    """The first replica's error (status, type, code), its message naming every replica that failed."""
    first = failed[0][1]
    if not isinstance(first, errors.APIError):
        raise first
    return errors.APIError(first.status, f"{what} failed on {len(failed)} of {total} scheduler replicas "
                           f"({_listed(failed)}); {outcome}", type=first.type, param=first.param, code=first.code,
                           headers=first.headers)
