"""EngineRouter: one gateway in front of several scheduler replicas (data parallel), each with its own workers and
its own prefix cache. It answers the EngineClient calls the gateway makes, over the replicas:

- generate: the replica chosen for the request (replica_choice.py: prefix affinity, KV events, load, LoRA),
  logged and sent back as x-steploop-replica headers (route_header.py). Failover: a replica that answers
  "unavailable" or "at capacity" before the request's first token (down, restarting, full queue) is skipped for
  `cooldown_s` and the request goes to the next one; once tokens flowed, a broken stream migrates the request to
  another replica with the tokens already delivered (migration.py). With --enable-kv-pull, a request whose prompt
  another replica caches further carries a hint to pull those blocks from there (kv_pull_cost.py).
- model info, health, metrics, LoRA adapters: the first replica that answers, or every one.

The replicas themselves, their health polling and KV-event watchers are replica_set.py's. The gateway builds a
router for two or more addresses (with one it talks to its EngineClient directly), or for
--scheduler-discovery-interval, where discovery.py adds and removes replicas as DNS changes (add_replica /
remove_replica).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence

from steploop.common.block_hashing import first_block_extra
from steploop.common.engine_contract import EngineChunk, EngineRequest, ModelInfo
from steploop.common.engine_control import ControlState
from steploop.gateway import errors
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.routing import route_header
from steploop.gateway.routing.affinity import AffinityMap
from steploop.gateway.routing.control_fanout import ControlFanout
from steploop.gateway.routing.kv_pull_cost import KvPullPlanner, KvPullPolicy
from steploop.gateway.routing.migration import DEFAULT_MAX_MIGRATIONS, DRAINING_CODE, Migration, Placement
from steploop.gateway.routing.replica import Replica
from steploop.gateway.routing.replica_choice import ReplicaChooser
from steploop.gateway.routing.replica_set import ReplicaSet

logger = logging.getLogger(__name__)

# APIError codes that mean "this replica cannot take it now"
RETRYABLE = {"engine_unavailable", "overloaded", DRAINING_CODE}


class EngineRouter:
    """The EngineClient calls the gateway makes (generate, model_info, health, close), over several scheduler
    replicas; /metrics asks it for every replica's text (metrics_texts). Create it inside the running event loop."""

    def __init__(self, clients: Sequence[EngineClient], *, block_size: int = 0, min_match: float = 0.5,
                 min_match_tokens: int = 64, imbalance: int = 8, cooldown_s: float = 2.0,
                 health_interval_s: float = 1.0, discovered: bool = False, kv_events: bool = True,
                 max_migrations: int = DEFAULT_MAX_MIGRATIONS, kv_pull: KvPullPolicy = KvPullPolicy()) -> None:
        if not clients and not discovered:   # discovered: replicas come and go, none at all is a state
            raise ValueError("at least one scheduler address is needed")
        self.pool = ReplicaSet(clients, health_interval_s=health_interval_s, kv_events=kv_events)
        self.replicas: list[Replica] = self.pool.replicas   # the same list: slots change in place
        self.affinity = AffinityMap(block_size)     # 0: taken from the first ModelInfo a replica answers
        self.chooser = ReplicaChooser(self.replicas, self.affinity, min_match=min_match,
                                      min_match_tokens=min_match_tokens, imbalance=imbalance)
        self.cooldown_s = cooldown_s
        self._learn_after = 0.0                      # monotonic time before which no model info is asked again
        self.migration = Migration(max_migrations)
        self.control = ControlFanout(lambda: self.live)   # pause, resume, weight updates over every replica
        self.pull = KvPullPlanner(kv_pull)           # pull a prefix cached elsewhere, or recompute it

    @property
    def live(self) -> list[Replica]:
        return self.pool.live

    def add_replica(self, client: EngineClient) -> None:
        self.pool.add(client)

    async def remove_replica(self, address: str) -> None:
        await self.pool.remove(address)

    @property
    def address(self) -> str:
        return ",".join(r.address for r in self.live)

    # ---- routing ----------------------------------------------------------------------------------------------
    def order(self, prompt_ids: Sequence[int], cache_salt: str = "", lora_name: str = "") -> list[int]:
        """Replica indices to try, best first, and records the choice in the affinity map."""
        return self.chooser.route(prompt_ids, cache_salt, lora_name)[0]

    def route(self, prompt_ids: Sequence[int], cache_salt: str = "",
              lora_name: str = "") -> tuple[list[int], int, str]:
        """(replica indices to try, best first; prompt tokens matched at the first; what chose it)."""
        return self.chooser.route(prompt_ids, cache_salt, lora_name)

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        """The request's chunks from the replica chosen for it, then from others it migrates to."""
        return self.migration.generate(self._route, request)

    async def _route(self, request: EngineRequest, avoid: frozenset[str],
                     placement: Placement) -> AsyncIterator[EngineChunk]:
        """One try of the request (resumed after its resume_output_token_ids), failing over before its first
        chunk; `avoid`: the replica it just failed on."""
        request_id, prompt_ids, cache_salt, lora_name = (request.request_id, request.prompt_token_ids,
                                                         request.cache_salt, request.lora_name)
        self.pool.start()
        if not self.live:
            raise errors.engine_unavailable("no scheduler replica is known yet (discovery found none); retry shortly")
        if not self.affinity.block_size and time.monotonic() >= self._learn_after:
            await self._learn_block_size()
        order, matched, source = self.route(prompt_ids, cache_salt, lora_name)
        order = [i for i in order if self.replicas[i].address not in avoid]
        if not order and all(r.fenced for r in self.live):
            raise errors.engine_unavailable("every scheduler replica is fenced (" + "; ".join(
                f"{r.address}: {r.fenced}" for r in self.live) + ")")
        if not order:
            raise errors.engine_unavailable(f"no scheduler replica other than {', '.join(sorted(avoid))} to move to")
        for attempt, index in enumerate(order):
            replica = self.replicas[index]
            if attempt or avoid:   # failed over or migrated: this replica is where the prefix's blocks will be now
                self.affinity.record(self.affinity.block_hashes(
                    prompt_ids, first_block_extra(cache_salt, lora_name) or ""), index)
                matched, source = 0, "failover"
            self._log_route(request_id, replica.address, matched, source)
            replica.in_flight += 1
            replica.routed += 1
            placement.address, placement.started = replica.address, False
            hint = self.pull.hint(self.replicas, index, prompt_ids, first_block_extra(cache_salt, lora_name) or "")
            if hint is not None:
                logger.info("request %s pulls %d prefix blocks from %s", request_id, hint.num_blocks, hint.source,
                            extra={"request_id": request_id, "kv_pull_source": hint.source})
            stream = replica.client.generate(dataclasses.replace(request, kv_pull=hint) if hint else request)
            self.chooser.lora_homes.record(lora_name, index)
            sent_at, measured = time.monotonic(), hint is not None or bool(request.resume_output_token_ids)
            try:
                async for chunk in stream:
                    placement.started = True
                    if not measured and chunk.usage is not None:     # the first chunk with tokens: the TTFT
                        measured = True
                        self.pull.observe(chunk.usage.prompt_tokens - chunk.usage.cached_tokens,
                                          time.monotonic() - sent_at)
                    yield chunk
                return
            except errors.APIError as err:
                if err.code in RETRYABLE:
                    replica.down_until = time.monotonic() + self.cooldown_s
                if placement.started or err.code not in RETRYABLE or attempt == len(order) - 1:
                    raise   # mid-generation: migration.py moves it
                logger.warning("scheduler %s cannot take %s (%s); trying the next replica", replica.address,
                               request_id, err.message)
            finally:
                replica.in_flight -= 1
                await stream.aclose()
                if replica.retired and replica.in_flight == 0:   # removed while this ran: the last one closes
                    await replica.client.close()

    @staticmethod
    def _log_route(request_id: str, address: str, matched: int, source: str) -> None:
        route_header.note(route_header.RouteNote(address, matched, source))
        logger.info("routed %s to %s (%s, %d prompt tokens cached there)", request_id, address, source, matched,
                    extra={"request_id": request_id, "replica": address, "route_source": source,
                           "matched_tokens": matched})

    # ---- the other Engine calls -------------------------------------------------------------------------------
    async def _first(self, call: str):
        """The first replica (in order, skipping those cooling down) whose `call` succeeds."""
        now = time.monotonic()
        ranked = sorted(self.live, key=lambda r: not r.up(now))
        last = errors.engine_unavailable("no scheduler replica is known yet (discovery found none)")
        for replica in ranked:
            try:
                return await getattr(replica.client, call)()
            except errors.APIError as err:
                last = err
        raise last

    async def model_info(self) -> ModelInfo:
        info = await self._first("model_info")
        if info.block_size:   # 0 while no worker is attached
            self.affinity.block_size = info.block_size
            self.pull.block_bytes = info.kv_block_bytes
        return info

    async def _learn_block_size(self) -> None:
        """The replicas' block size, for affinity; none answering is not this request's failure (it routes by load)."""
        self._learn_after = time.monotonic() + 1.0   # at most one try a second, not one per request
        try:
            await self.model_info()
        except errors.APIError as err:
            logger.debug("no replica's block size yet (%s); routing by load", err.message)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Every replica registers it (each checks it; the first refusal is the answer)."""
        await asyncio.gather(*(r.client.load_lora_adapter(name, path) for r in self.live))

    async def unload_lora_adapter(self, name: str) -> None:
        await asyncio.gather(*(r.client.unload_lora_adapter(name) for r in self.live))
        self.chooser.lora_homes.forget(name)

    # ---- engine control: every replica changes together, or none does (control_fanout.py) ----
    async def pause(self, mode: str) -> ControlState:
        self.pool.start()
        return await self.control.all_or_none("pause", "resume", mode)

    async def resume(self) -> ControlState:
        self.pool.start()
        return await self.control.reach_all("resume")

    async def control_state(self) -> ControlState:
        self.pool.start()
        return await self.control.state()

    async def update_weights_from_disk(self, model_path: str, weight_version: str = "") -> ControlState:
        self.pool.start()
        return await self.control.update_weights(
            lambda client: client.update_weights_from_disk(model_path, weight_version, stage_only=True),
            weight_version)

    async def init_weights_update_group(self, group: dict) -> ControlState:
        """Replica after replica takes the next ranks: each joins from rank_offset + the worker ranks before it."""
        self.pool.start()
        offset, states = group["rank_offset"], []
        infos = await asyncio.gather(*(r.client.model_info() for r in self.live))
        for replica, info in zip(self.live, infos):
            states.append(replica.client.init_weights_update_group({**group, "rank_offset": offset}))
            offset += max(info.num_workers, 1)
        return self.control.merged(self.live, await asyncio.gather(*states))

    async def update_weights_from_distributed(self, buckets: list[dict], weight_version: str = "",
                                              group_name: str = "") -> ControlState:
        """Every replica receives the same broadcast at once (the collective needs every rank), staged; then all
        commit or all drop."""
        self.pool.start()
        return await self.control.update_weights(
            lambda client: client.update_weights_from_distributed(buckets, weight_version, group_name,
                                                                  stage_only=True),
            weight_version)

    async def sleep(self, level: int) -> ControlState:
        self.pool.start()
        return await self.control.all_or_none("sleep", "wake_up", level)

    async def wake_up(self) -> ControlState:
        self.pool.start()
        return await self.control.reach_all("wake_up")

    async def health(self) -> bool:
        """Ready when any replica is (the others are routed around)."""
        self.pool.start()
        return any(await self.pool.check_health())

    def replica_samples(self) -> list[tuple[str, str, str, dict[str, float]]]:
        """(name, type, help, {replica: value}) of the router's own per-replica series, for /metrics."""
        return self.pool.samples()

    async def metrics_texts(self) -> list[tuple[str, str]]:
        """(address, Prometheus text) of every replica that answers."""
        live = self.live
        results = await asyncio.gather(*(r.client.metrics_text() for r in live), return_exceptions=True)
        return [(r.address, text) for r, text in zip(live, results) if isinstance(text, str)]

    async def close(self) -> None:
        await self.pool.close()

