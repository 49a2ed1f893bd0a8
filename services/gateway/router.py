"""EngineRouter: one gateway in front of several scheduler replicas (data parallel), each with its own workers and
its own prefix cache. It answers the EngineClient calls the gateway makes, choosing a replica per request:

- Prefix affinity. A request goes where its prompt's prefix was last sent, so it finds that prefix in that
  replica's cache. The router keeps the schedulers' own key (services/common/block_hashing.py: chained over full
  blocks of the model's block_size tokens, from ModelInfo, with the request's cache salt), in a bounded LRU map
  block hash -> replica; until the block size is known (no replica answered model info yet) it routes by load.
  The prompt's deepest known block names the replica; the match counts when it covers at least `min_match` of
  the prompt (as SGLang's cache-aware router's threshold) and `min_match_tokens`, so a shared chat-template header
  or default system prompt alone (a few dozen tokens, little prefill to save) does not pin every conversation to
  one replica.
- Load. Without a match, or when the affine replica has `imbalance` more requests in flight than the least loaded
  one (and at least half as many again), the least loaded replica takes it (ties: the lowest rendezvous hash of
  the whole prompt, so equal load still spreads). In-flight counts are the gateway's own, so they are
  exact and free.
- Failover. A replica that answers "unavailable" or "at capacity" before the request's first token (down,
  restarting, full queue) is skipped for `cooldown_s` and the request goes to the next one; once tokens flowed, an
  error is the request's (it cannot be replayed elsewhere without the client seeing it twice). Each replica's
  grpc health is also polled every `health_interval_s`: one that is not SERVING (no worker attached, hung,
  draining) gets no new requests while another one is.

The gateway builds one for two or more addresses (with one it talks to its EngineClient directly), or for
--scheduler-discovery-interval, where discovery.py adds and removes replicas as DNS changes (add_replica /
remove_replica; a removed replica's slot is reused, so the affinity map's indices stay valid hints).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import struct
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from services.common.block_hashing import BlockHasher, block_hashes, first_block_extra, get_block_hasher
from services.common.engine_contract import EngineChunk, ModelInfo
from services.common.sampling_params import SamplingParams
from services.gateway import errors
from services.gateway.engine_client import EngineClient
from services.gateway.lora_routing import LoraHomes

logger = logging.getLogger(__name__)

RETRYABLE = {"engine_unavailable", "overloaded"}   # APIError codes that mean "this replica cannot take it now"


@dataclass
class Replica:
    client: EngineClient
    in_flight: int = 0
    down_until: float = 0.0
    healthy: bool = True                             # its last grpc health check said SERVING
    routed: int = 0                                  # requests sent here (for logs and tests)
    retired: bool = False                            # removed (discovery): no new requests; slot reusable

    @property
    def address(self) -> str:
        return self.client.address

    def up(self, now: float) -> bool:
        return self.healthy and not self.retired and now >= self.down_until


@dataclass
class AffinityMap:
    """Chained block hashes -> index of the replica that last got a prompt with that prefix (LRU, bounded).
    block_size 0: not known yet, so no prompt has blocks."""
    block_size: int = 0
    capacity: int = 200_000
    hasher: BlockHasher = field(default_factory=get_block_hasher)
    _map: OrderedDict = field(default_factory=OrderedDict)

    def block_hashes(self, prompt_ids: Sequence[int], salt: str = "") -> list[bytes]:
        if not self.block_size:
            return []
        return block_hashes(prompt_ids, self.block_size, salt, self.hasher)

    def deepest(self, hashes: list[bytes]) -> tuple[int, int] | None:
        """(replica, number of blocks matched) of the deepest block already routed, or None."""
        for depth in range(len(hashes), 0, -1):
            replica = self._map.get(hashes[depth - 1])
            if replica is not None:
                return replica, depth
        return None

    def record(self, hashes: list[bytes], replica: int) -> None:
        for h in hashes:
            self._map[h] = replica
            self._map.move_to_end(h)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)


class EngineRouter:
    """The EngineClient calls the gateway makes (generate, model_info, health, close), over several scheduler
    replicas; /metrics asks it for every replica's text (metrics_texts). Create it inside the running event loop."""

    def __init__(self, clients: Sequence[EngineClient], *, block_size: int = 0, min_match: float = 0.5,
                 min_match_tokens: int = 64, imbalance: int = 8, cooldown_s: float = 2.0,
                 health_interval_s: float = 1.0, discovered: bool = False) -> None:
        if not clients and not discovered:   # discovered: replicas come and go, none at all is a state
            raise ValueError("at least one scheduler address is needed")
        self.replicas = [Replica(c) for c in clients]
        self.affinity = AffinityMap(block_size)     # 0: taken from the first ModelInfo a replica answers
        self.lora_homes = LoraHomes()                 # replicas that ran each LoRA adapter
        self.min_match, self.min_match_tokens = min_match, min_match_tokens
        self.imbalance, self.cooldown_s = imbalance, cooldown_s
        self.health_interval_s = health_interval_s
        self._poller: asyncio.Task | None = None
        self._learn_after = 0.0                      # monotonic time before which no model info is asked again

    def _poll_health(self) -> None:
        """Started with the first routed request (the router is built before the event loop serves)."""
        if self._poller is None:
            self._poller = asyncio.create_task(self._health_loop(), name="replica-health")

    async def _health_loop(self) -> None:
        while True:
            await self._check_health()
            await asyncio.sleep(self.health_interval_s)

    @property
    def live(self) -> list[Replica]:
        return [r for r in self.replicas if not r.retired]

    def add_replica(self, client: EngineClient) -> None:
        """Routes to `client` from now on, in a retired slot whose requests have all ended, else a new one."""
        for index, replica in enumerate(self.replicas):
            if replica.retired and replica.in_flight == 0:
                self.replicas[index] = Replica(client)
                return
        self.replicas.append(Replica(client))

    async def remove_replica(self, address: str) -> None:
        """No new requests go to `address`; those in flight there finish, then its channel closes."""
        for replica in self.live:
            if replica.address == address:
                replica.retired = True
                if replica.in_flight == 0:
                    await replica.client.close()

    async def _check_health(self) -> list[bool]:
        live = self.live
        states = await asyncio.gather(*(r.client.health() for r in live))
        for replica, serving in zip(live, states):
            if replica.healthy != serving:
                log = logger.info if serving else logger.warning
                log("scheduler %s is %s", replica.address, "serving again" if serving else
                    "not serving: no new requests go there until it is")
            replica.healthy = serving
        return states

    @property
    def address(self) -> str:
        return ",".join(r.address for r in self.live)

    # ---- routing ----------------------------------------------------------------------------------------------
    def order(self, prompt_ids: Sequence[int], cache_salt: str = "", lora_name: str = "") -> list[int]:
        """Replica indices to try, best first, and records the choice in the affinity map. A LoRA request goes to
        a replica that already ran its adapter (lora_routing.py) unless that one is much busier."""
        cache_salt = first_block_extra(cache_salt, lora_name) or ""
        now = time.monotonic()
        live = [i for i, r in enumerate(self.replicas) if not r.retired]
        up = [i for i in live if self.replicas[i].up(now)] or live
        hashes = self.affinity.block_hashes(prompt_ids, cache_salt)
        # Rendezvous order over the whole prompt: chat prompts share their first blocks (the template's header,
        # a default system prompt), so ranking by those would send every new conversation to one replica.
        whole = hashlib.blake2b(struct.pack(f"<{len(prompt_ids)}I", *prompt_ids), digest_size=16).digest()
        by_hash = sorted(up, key=lambda i: hashlib.blake2b(whole + i.to_bytes(4, "little"), digest_size=8).digest())
        least = min(by_hash, key=lambda i: self.replicas[i].in_flight)
        choice = least
        match = self.affinity.deepest(hashes)
        if match is not None and match[0] in up:
            replica, depth = match
            matched = depth * self.affinity.block_size
            load, low = self.replicas[replica].in_flight, self.replicas[least].in_flight
            worth_it = matched >= self.min_match_tokens and matched >= self.min_match * len(prompt_ids)
            if worth_it and not (load - low > self.imbalance and load > 1.5 * low):
                choice = replica
        choice = self.lora_homes.prefer(lora_name, choice, up, lambda i: self.replicas[i].in_flight, self.imbalance)
        self.affinity.record(hashes, choice)
        rest = [i for i in by_hash if i != choice]
        down = [i for i in live if i not in up]
        return [choice, *rest, *down]

    async def generate(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, *,
                       priority: int = 0, cache_salt: str = "", pooling=None,
                       lora_name: str = "") -> AsyncIterator[EngineChunk]:
        self._poll_health()
        if not self.live:
            raise errors.engine_unavailable("no scheduler replica is known yet (discovery found none); retry shortly")
        if not self.affinity.block_size and time.monotonic() >= self._learn_after:
            await self._learn_block_size()
        order = self.order(prompt_ids, cache_salt, lora_name)
        for attempt, index in enumerate(order):
            replica = self.replicas[index]
            if attempt:   # failed over: this replica is where the prefix's blocks will be now
                self.affinity.record(self.affinity.block_hashes(prompt_ids,
                                                                first_block_extra(cache_salt, lora_name) or ""), index)
            replica.in_flight += 1
            replica.routed += 1
            started = False
            stream = replica.client.generate(request_id, prompt_ids, params, priority=priority, cache_salt=cache_salt,
                                             pooling=pooling, lora_name=lora_name)
            self.lora_homes.record(lora_name, index)
            try:
                async for chunk in stream:
                    started = True
                    yield chunk
                return
            except errors.APIError as err:
                if started or err.code not in RETRYABLE or attempt == len(order) - 1:
                    raise
                replica.down_until = time.monotonic() + self.cooldown_s
                logger.warning("scheduler %s cannot take %s (%s); trying the next replica", replica.address,
                               request_id, err.message)
            finally:
                replica.in_flight -= 1
                await stream.aclose()
                if replica.retired and replica.in_flight == 0:   # removed while this ran: the last one closes
                    await replica.client.close()

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
        self.lora_homes.forget(name)

    async def health(self) -> bool:
        """Ready when any replica is (the others are routed around)."""
        self._poll_health()
        return any(await self._check_health())

    def replica_samples(self) -> list[tuple[str, str, str, dict[str, float]]]:
        """(name, type, help, {replica: value}) of the router's own per-replica series, for /metrics."""
        now = time.monotonic()
        return [
            ("steploop:replica_up", "gauge", "1 while the gateway routes new requests to this scheduler replica",
             {r.address: float(r.up(now)) for r in self.live}),
            ("steploop:replica_in_flight", "gauge", "Requests this gateway has in flight on the replica",
             {r.address: float(r.in_flight) for r in self.live}),
            ("steploop:replica_routed", "counter", "Requests this gateway sent to the replica (failover tries too)",
             {r.address: float(r.routed) for r in self.live}),
        ]

    async def metrics_texts(self) -> list[tuple[str, str]]:
        """(address, Prometheus text) of every replica that answers."""
        live = self.live
        results = await asyncio.gather(*(r.client.metrics_text() for r in live), return_exceptions=True)
        return [(r.address, text) for r, text in zip(live, results) if isinstance(text, str)]

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        await asyncio.gather(*(r.client.close() for r in self.replicas if not (r.retired and r.in_flight == 0)))
