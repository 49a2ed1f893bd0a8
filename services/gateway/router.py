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
- KV events. A replica that publishes them (scheduler --kv-events-config) is matched against its real cache
  instead (kv_index.py: the prompt's longest prefix of full blocks it holds, hashed with its own function and
  root); the guess above is the fallback for replicas that do not, and for a prefix no replica holds yet (it
  may be in flight where the guess sent it). The decision is logged and sent back as x-steploop-replica
  headers (route_header.py).
- Load. Without a match, or when the affine replica has `imbalance` more requests in flight than the least loaded
  one (and at least half as many again), the least loaded replica takes it (ties: the lowest rendezvous hash of
  the whole prompt, so equal load still spreads). In-flight counts are the gateway's own, so they are
  exact and free.
- Failover. A replica that answers "unavailable" or "at capacity" before the request's first token (down,
  restarting, full queue) is skipped for `cooldown_s` and the request goes to the next one; once tokens flowed,
  a broken stream migrates the request to another replica with the tokens already delivered (migration.py).
  Each replica's grpc health is also polled every `health_interval_s`: one that is not SERVING (no worker
  attached, hung, draining) gets no new requests while another one is, and its live requests migrate.

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
from services.common.engine_contract import EngineChunk, EngineRequest, ModelInfo
from services.gateway import errors, route_header
from services.gateway.engine_client import EngineClient
from services.gateway.kv_index import KvEventWatcher, ReplicaCacheIndex
from services.gateway.migration import DEFAULT_MAX_MIGRATIONS, DRAINING_CODE, Migration, Placement, draining_error
from services.gateway.lora_routing import LoraHomes

logger = logging.getLogger(__name__)

# APIError codes that mean "this replica cannot take it now"
RETRYABLE = {"engine_unavailable", "overloaded", DRAINING_CODE}


@dataclass
class Replica:
    client: EngineClient
    in_flight: int = 0
    down_until: float = 0.0
    healthy: bool = True                             # its last grpc health check said SERVING
    routed: int = 0                                  # requests sent here (for logs and tests)
    retired: bool = False                            # removed (discovery): no new requests; slot reusable
    cache: ReplicaCacheIndex = field(default_factory=ReplicaCacheIndex)   # from its KV events, when in sync
    watcher: KvEventWatcher | None = None

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
                 health_interval_s: float = 1.0, discovered: bool = False, kv_events: bool = True,
                 max_migrations: int = DEFAULT_MAX_MIGRATIONS) -> None:
        if not clients and not discovered:   # discovered: replicas come and go, none at all is a state
            raise ValueError("at least one scheduler address is needed")
        self.replicas = [Replica(c) for c in clients]
        self.affinity = AffinityMap(block_size)     # 0: taken from the first ModelInfo a replica answers
        self.lora_homes = LoraHomes()                 # replicas that ran each LoRA adapter
        self.min_match, self.min_match_tokens = min_match, min_match_tokens
        self.imbalance, self.cooldown_s = imbalance, cooldown_s
        self.health_interval_s = health_interval_s
        self.kv_events = kv_events                   # watch replicas' KV events (those with them off: guess)
        self._poller: asyncio.Task | None = None
        self._learn_after = 0.0                      # monotonic time before which no model info is asked again
        self.migration = Migration(max_migrations)

    def _poll_health(self) -> None:
        """Started with the first routed request (the router is built before the event loop serves)."""
        if self._poller is None:
            self._poller = asyncio.create_task(self._health_loop(), name="replica-health")
            for replica in self.live:
                self._watch(replica)

    def _watch(self, replica: Replica) -> None:
        if self.kv_events and replica.watcher is None:
            replica.watcher = KvEventWatcher(replica.client, replica.cache)
            replica.watcher.start()

    async def _health_loop(self) -> None:
        while True:
            await self._check_health()
            await asyncio.sleep(self.health_interval_s)

    @property
    def live(self) -> list[Replica]:
        return [r for r in self.replicas if not r.retired]

    def add_replica(self, client: EngineClient) -> None:
        """Routes to `client` from now on, in a retired slot whose requests have all ended, else a new one."""
        new = Replica(client)
        for index, replica in enumerate(self.replicas):
            if replica.retired and replica.in_flight == 0:
                self.replicas[index] = new
                break
        else:
            self.replicas.append(new)
        if self._poller is not None:
            self._watch(new)

    async def remove_replica(self, address: str) -> None:
        """No new requests go to `address`; those in flight there finish, then its channel closes."""
        for replica in self.live:
            if replica.address == address:
                replica.retired = True
                if replica.watcher is not None:
                    await replica.watcher.stop()
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
        now = time.monotonic()
        for replica, serving in zip(live, states):
            if not serving and replica.in_flight and any(r.up(now) for r in live):   # somewhere to go
                moved = replica.client.evict(lambda a=replica.address: draining_error(a))
                if moved:
                    logger.warning("scheduler %s is not serving: migrating its %d live requests", replica.address,
                                   moved)
        return states

    @property
    def address(self) -> str:
        return ",".join(r.address for r in self.live)

    # ---- routing ----------------------------------------------------------------------------------------------
    def order(self, prompt_ids: Sequence[int], cache_salt: str = "", lora_name: str = "") -> list[int]:
        """Replica indices to try, best first, and records the choice in the affinity map."""
        return self.route(prompt_ids, cache_salt, lora_name)[0]

    def route(self, prompt_ids: Sequence[int], cache_salt: str = "",
              lora_name: str = "") -> tuple[list[int], int, str]:
        """(replica indices to try, best first; prompt tokens matched at the first; "events", "guess", "load" or
        "lora": what chose it). Records the choice in the affinity map. A LoRA request goes to a replica that
        already ran its adapter (lora_routing.py) unless that one is much busier."""
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
        choice, chosen_match, source = least, 0, "load"
        match = self._best_match(prompt_ids, cache_salt, hashes, by_hash)
        if match is not None:
            replica, matched, how = match
            load, low = self.replicas[replica].in_flight, self.replicas[least].in_flight
            worth_it = matched >= self.min_match_tokens and matched >= self.min_match * len(prompt_ids)
            if worth_it and not (load - low > self.imbalance and load > 1.5 * low):
                choice, chosen_match, source = replica, matched, how
        preferred = self.lora_homes.prefer(lora_name, choice, up, lambda i: self.replicas[i].in_flight, self.imbalance)
        if preferred != choice:
            choice, chosen_match, source = preferred, 0, "lora"
        self.affinity.record(hashes, choice)
        rest = [i for i in by_hash if i != choice]
        down = [i for i in live if i not in up]
        return [choice, *rest, *down], chosen_match, source

    def _best_match(self, prompt_ids: Sequence[int], cache_salt: str, hashes: list[bytes],
                    candidates: list[int]) -> tuple[int, int, str] | None:
        """(replica, matched tokens, how): the longest prefix a replica's KV events say it caches (ties: the
        less loaded, then rendezvous order); without one, where the prefix was last sent (the guess)."""
        memo: dict = {}
        best: tuple[int, int] | None = None
        for i in candidates:
            cache = self.replicas[i].cache
            if cache.synced:
                matched = cache.matched_tokens(prompt_ids, cache_salt, memo)
                if matched and (best is None or (matched, -self.replicas[i].in_flight) >
                                (best[1], -self.replicas[best[0]].in_flight)):
                    best = (i, matched)
        if best is not None:
            return best[0], best[1], "events"
        guess = self.affinity.deepest(hashes)
        if guess is not None and guess[0] in candidates:
            return guess[0], guess[1] * self.affinity.block_size, "guess"
        return None

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        """The request's chunks from the replica chosen for it, then from others it migrates to."""
        return self.migration.generate(self._route, request)

    async def _route(self, request: EngineRequest, avoid: frozenset[str],
                     placement: Placement) -> AsyncIterator[EngineChunk]:
        """One try of the request (resumed after its resume_output_token_ids), failing over before its first
        chunk; `avoid`: the replica it just failed on."""
        request_id, prompt_ids, cache_salt, lora_name = (request.request_id, request.prompt_token_ids,
                                                         request.cache_salt, request.lora_name)
        self._poll_health()
        if not self.live:
            raise errors.engine_unavailable("no scheduler replica is known yet (discovery found none); retry shortly")
        if not self.affinity.block_size and time.monotonic() >= self._learn_after:
            await self._learn_block_size()
        order, matched, source = self.route(prompt_ids, cache_salt, lora_name)
        order = [i for i in order if self.replicas[i].address not in avoid]
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
            stream = replica.client.generate(request)
            self.lora_homes.record(lora_name, index)
            try:
                async for chunk in stream:
                    placement.started = True
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
            ("steploop:replica_kv_events_synced", "gauge",
             "1 while the router's view of the replica's prefix cache follows its KV events (0: routing by guess)",
             {r.address: float(r.cache.synced) for r in self.live}),
            ("steploop:replica_kv_cached_blocks", "gauge", "Prefix-cache blocks the replica's KV events say it holds",
             {r.address: float(len(r.cache.keys)) for r in self.live if r.cache.synced}),
            ("steploop:replica_kv_events_sequence", "gauge",
             "The next KV event batch expected from the replica (all before it are applied)",
             {r.address: float(r.cache.next_sequence) for r in self.live if r.cache.synced}),
        ]

    async def metrics_texts(self) -> list[tuple[str, str]]:
        """(address, Prometheus text) of every replica that answers."""
        live = self.live
        results = await asyncio.gather(*(r.client.metrics_text() for r in live), return_exceptions=True)
        return [(r.address, text) for r, text in zip(live, results) if isinstance(text, str)]

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        await asyncio.gather(*(r.watcher.stop() for r in self.replicas if r.watcher is not None))
        await asyncio.gather(*(r.client.close() for r in self.replicas if not (r.retired and r.in_flight == 0)))
