"""KvPullPlanner: whether the replica a request goes to should pull its prompt's prefix from another replica that
caches it (common/kv_pull.py), as LMCache's and Mooncake's cross-instance sharing does.

The router chose replica B (A is loaded, affinity or LoRA said B, A failed over). When another replica A's KV
events say its pool holds more of the prompt's leading blocks than B holds in any tier, the extra blocks could be
copied instead of recomputed. The estimate, per request:

    pull       = latency + extra_blocks * block_bytes / bandwidth          (--kv-pull-bandwidth, the link's GB/s)
    recompute  = extra_blocks * block_size / prefill_rate                  (measured: uncached prompt tokens per
                                                                            second of TTFT, over requests this
                                                                            router sent without a hint)

A hint goes with the request when pull < recompute and the extra blocks hold at least --kv-pull-min-tokens
tokens; until a rate is measured (or the block size in bytes is known), any pull of that many tokens is taken as
worth it (a copy over a link against a forward pass). Only A's pool blocks count: those are what A can send.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from steploop.common import envs
from steploop.common.kv_pull import KvPullHint

if TYPE_CHECKING:
    from steploop.gateway.routing.replica import Replica

LATENCY_S = 0.005          # a call to A, a plan step there and the answer, beside the bytes
RATE_WEIGHT = 0.2          # each new prefill-rate sample's weight in the moving average
MIN_SAMPLE_TOKENS = 64     # shorter uncached prompts say more about step overhead than about prefill speed


@dataclass(frozen=True)
class KvPullPolicy:
    enable: bool = False          # --enable-kv-pull
    bandwidth_gbps: float = 1.0   # --kv-pull-bandwidth: GB/s between replicas' workers
    min_tokens: int = 256         # --kv-pull-min-tokens: shorter prefixes are recomputed

    def __post_init__(self) -> None:
        if self.bandwidth_gbps <= 0:
            raise ValueError(f"--kv-pull-bandwidth must be > 0 (GB/s), got {self.bandwidth_gbps}")
        if self.min_tokens < 1:
            raise ValueError(f"--kv-pull-min-tokens must be >= 1, got {self.min_tokens}")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        d = KvPullPolicy()
        envs.add_flag(parser, "--enable-kv-pull", type=bool, default=d.enable,
                      help="with several scheduler replicas: a request routed to one replica while another's KV "
                           "events say it caches a longer prefix of the prompt carries a hint to pull those blocks "
                           "from there instead of recomputing them, when the estimate favours it (replicas' "
                           "workers need --kv-role both)")
        envs.add_flag(parser, "--kv-pull-bandwidth", type=float, default=d.bandwidth_gbps,
                      help="GB/s between replicas' workers, for the pull-or-recompute estimate")
        envs.add_flag(parser, "--kv-pull-min-tokens", type=int, default=d.min_tokens,
                      help="pull only when the blocks to pull hold at least this many prompt tokens")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> KvPullPolicy:
        return cls(args.enable_kv_pull, args.kv_pull_bandwidth, args.kv_pull_min_tokens)


class KvPullPlanner:
    def __init__(self, policy: KvPullPolicy) -> None:
        self.policy = policy
        self.block_bytes = 0                 # from ModelInfo.kv_block_bytes (0: not known yet)
        self.prefill_rate = 0.0              # uncached prompt tokens per second of TTFT (0: not measured yet)
        self.hints = 0                       # hints attached (for logs and tests)

    def worth(self, tokens: int, num_blocks: int) -> bool:
        """Pulling num_blocks blocks holding `tokens` prompt tokens beats recomputing them."""
        if tokens < self.policy.min_tokens:
            return False
        if not self.prefill_rate or not self.block_bytes:
            return True
        pull = LATENCY_S + num_blocks * self.block_bytes / (self.policy.bandwidth_gbps * 1e9)
        return pull < tokens / self.prefill_rate

    def observe(self, uncached_tokens: int, ttft_s: float) -> None:
        """A request served without a pull: its TTFT over its uncached prompt tokens is a prefill-rate sample."""
        if uncached_tokens < MIN_SAMPLE_TOKENS or ttft_s <= 0:
            return
        rate = uncached_tokens / ttft_s
        self.prefill_rate = rate if not self.prefill_rate else \
            (1 - RATE_WEIGHT) * self.prefill_rate + RATE_WEIGHT * rate

    def hint(self, replicas: Sequence[Replica], choice: int, prompt_ids: Sequence[int],
             salt: str) -> KvPullHint | None:
        """The hint for a request going to replicas[choice], or None (off, nothing better cached elsewhere, or
        not worth it)."""
        dest = replicas[choice].cache
        if not self.policy.enable or not dest.synced:
            return None
        memo: dict = {}
        have_tokens = dest.matched_tokens(prompt_ids, salt, memo)    # 0 while it never stored a block
        best: tuple[int, Replica] | None = None
        for i, replica in enumerate(replicas):
            cache = replica.cache
            if (i == choice or replica.retired or not replica.healthy or not cache.synced or not cache.block_size
                    or cache.hasher_id != dest.hasher_id or dest.block_size not in (0, cache.block_size)):
                continue          # its keys are not the keys B will ask for
            blocks = cache.pool_blocks(prompt_ids, salt, memo)
            if best is None or blocks > best[0]:
                best = (blocks, replica)
        if best is None:
            return None
        source = best[1]
        block_size = source.cache.block_size
        have = have_tokens // block_size
        # The last prompt token is always computed (logits to sample): a block that would hold it is not pulled.
        blocks = min(best[0], (len(prompt_ids) - 1) // block_size)
        if blocks <= have or not self.worth((blocks - have) * block_size, blocks - have):
            return None
        self.hints += 1
        return KvPullHint(source.address, blocks)
