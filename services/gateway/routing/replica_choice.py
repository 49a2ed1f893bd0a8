"""ReplicaChooser: which scheduler replica a prompt goes to, best first.

- Prefix affinity. A request goes where its prompt's prefix was last sent, so it finds that prefix in that
  replica's cache (affinity.py); until the block size is known (no replica answered model info yet) it routes by
  load. The prompt's deepest known block names the replica; the match counts when it covers at least `min_match`
  of the prompt (as SGLang's cache-aware router's threshold) and `min_match_tokens`, so a shared chat-template
  header or default system prompt alone (a few dozen tokens, little prefill to save) does not pin every
  conversation to one replica.
- KV events. A replica that publishes them (scheduler --kv-events-config) is matched against its real cache
  instead (kv_index.py: the prompt's longest prefix of full blocks it holds, hashed with its own function and
  root); the guess above is the fallback for replicas that do not, and for a prefix no replica holds yet (it
  may be in flight where the guess sent it).
- Load. Without a match, or when the affine replica has `imbalance` more requests in flight than the least loaded
  one (and at least half as many again), the least loaded replica takes it (ties: the lowest rendezvous hash of
  the whole prompt, so equal load still spreads). In-flight counts are the gateway's own, so they are exact and
  free.
- LoRA. A LoRA request goes to a replica that already ran its adapter (lora_routing.py) unless that one is much
  busier.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Sequence

from steploop.common.block_hashing import first_block_extra
from steploop.gateway.routing.affinity import AffinityMap
from steploop.gateway.routing.lora_routing import LoraHomes
from steploop.gateway.routing.replica import Replica


class ReplicaChooser:
    def __init__(self, replicas: list[Replica], affinity: AffinityMap, *, min_match: float, min_match_tokens: int,
                 imbalance: int) -> None:
        self.replicas = replicas                     # the router's list (slots change in place)
        self.affinity = affinity
        self.lora_homes = LoraHomes()                # replicas that ran each LoRA adapter
        self.min_match, self.min_match_tokens, self.imbalance = min_match, min_match_tokens, imbalance

    def route(self, prompt_ids: Sequence[int], cache_salt: str = "",
              lora_name: str = "") -> tuple[list[int], int, str]:
        """(replica indices to try, best first; prompt tokens matched at the first; "events", "guess", "load" or
        "lora": what chose it). Records the choice in the affinity map."""
        cache_salt = first_block_extra(cache_salt, lora_name) or ""
        now = time.monotonic()
        live = [i for i, r in enumerate(self.replicas) if not r.retired and not r.fenced]   # fenced: never
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
