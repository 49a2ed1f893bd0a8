"""SchedulerConfig: the scheduler's knobs, frozen once the service starts.

Facts learned at run time (max_model_len, number of KV blocks, block size) come from the worker's hello and live
in scheduler state, never here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from steploop.common import envs
from steploop.common.block_hashing import BLOCK_HASHERS, DEFAULT_HASHER, get_block_hasher
from steploop.scheduler.kv_events.config import KvEventsConfig, KvEventsConfigError


class SchedulerConfigError(ValueError):
    """A config value is out of range; the message says which value and how to fix it."""


@dataclass(frozen=True)
class SchedulerConfig:
    # Tokens scheduled per step at most, summed over every request in the batch (prompt chunks + decodes).
    max_num_batched_tokens: int = 2048
    # Requests running at once at most (the batch size for decode-only steps).
    max_num_seqs: int = 128
    # A request gets at most this many tokens in one step, so one long prompt cannot starve others. 0 = off.
    long_prefill_token_threshold: int = 0
    # A step that carries prompt chunks beside decodes may take at most this many times as long as its decodes
    # alone would (predicted from the worker's measured step times, prefill_pacing.py), so streams keep a steady
    # inter-token latency while long prompts arrive, on any hardware. 0 = off (only the token budget applies).
    max_decode_slowdown: float = 2.0
    # Reuse the KV of full blocks whose prefix (token ids + cache salt) was computed before.
    enable_prefix_caching: bool = True
    # The prefix-cache block key (services/common/block_hashing.py): "sha256" (steploop's) or "sha256_cbor"
    # (vLLM's, so routers written for vLLM's KV events compute the same keys; needs steploop[kv-events]).
    prefix_caching_hash_algo: str = DEFAULT_HASHER
    # KV events (vLLM's --kv-events-config fields): prefix-cache changes over ZMQ and Engine.WatchKVEvents.
    kv_events: KvEventsConfig = field(default_factory=KvEventsConfig)
    # "fcfs": arrival order (preempted first); "priority": by (priority, arrival), and may preempt for a better one.
    scheduling_policy: str = "fcfs"
    # Plan step N+1 before step N's result is back (one output placeholder per decoding request), so the worker
    # never waits for a round trip. Needs an engine loop that keeps one plan in flight; harmless without one.
    async_scheduling: bool = True
    # Fraction of KV blocks that admitting a waiting request must leave free, so running requests can grow into
    # them instead of being preempted right after an admission (thrashing). Running requests may use them.
    admission_watermark: float = 0.01
    # Speculative decoding by n-gram prompt lookup: draft tokens proposed per step and request; 0 = off.
    num_speculative_tokens: int = 0
    # n-gram sizes tried, longest first: the last n tokens are looked up earlier in the request's own tokens.
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # Vision-language models (encoder_budget.py): image placeholder tokens whose encoder runs in one step at most
    # (a tower that runs a slice of layers per step counts a layer as length / layers), and the worker's encoder
    # cache size in embeddings (images being prefilled or encoded hold theirs). 0 = max_num_batched_tokens (the
    # budget), the larger of the budget and max_num_batched_tokens (the cache).
    max_num_encoder_input_tokens: int = 0
    encoder_cache_size: int = 0

    @property
    def encoder_budget(self) -> int:
        return self.max_num_encoder_input_tokens or self.max_num_batched_tokens

    @property
    def encoder_cache_tokens(self) -> int:
        return self.encoder_cache_size or max(self.encoder_budget, self.max_num_batched_tokens)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise SchedulerConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1; "
                "set --max-num-batched-tokens (or STEPLOOP_MAX_NUM_BATCHED_TOKENS) to e.g. 2048")
        if self.max_num_seqs < 1:
            raise SchedulerConfigError(
                f"max_num_seqs={self.max_num_seqs} must be >= 1; set --max-num-seqs (or STEPLOOP_MAX_NUM_SEQS) "
                "to e.g. 128")
        if self.max_num_seqs > self.max_num_batched_tokens:
            # Every running request needs at least one token per step to decode.
            raise SchedulerConfigError(
                f"max_num_seqs={self.max_num_seqs} > max_num_batched_tokens={self.max_num_batched_tokens}: "
                "a step could not give every running request one token; raise --max-num-batched-tokens "
                "or lower --max-num-seqs")
        if self.max_num_encoder_input_tokens < 0 or self.encoder_cache_size < 0:
            raise SchedulerConfigError(
                f"max_num_encoder_input_tokens={self.max_num_encoder_input_tokens} and encoder_cache_size="
                f"{self.encoder_cache_size} must be >= 0 (0 = max_num_batched_tokens)")
        if self.long_prefill_token_threshold < 0:
            raise SchedulerConfigError(
                f"long_prefill_token_threshold={self.long_prefill_token_threshold} must be >= 0 (0 = off); "
                "set --long-prefill-token-threshold to 0 or a positive chunk size")
        if self.max_decode_slowdown != 0 and not self.max_decode_slowdown >= 1.0:
            raise SchedulerConfigError(
                f"max_decode_slowdown={self.max_decode_slowdown} must be 0 (off) or >= 1; set "
                "--max-decode-slowdown to e.g. 2 (a step with prompt chunks may take 2x its decodes' time)")
        self._validate_features()

    def _validate_features(self) -> None:
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise SchedulerConfigError(
                f"scheduling_policy={self.scheduling_policy!r} is unknown; set --scheduling-policy to fcfs or priority")
        try:
            get_block_hasher(self.prefix_caching_hash_algo)
        except ValueError as err:
            raise SchedulerConfigError(f"prefix_caching_hash_algo={self.prefix_caching_hash_algo!r}: {err}; set "
                                       f"--prefix-caching-hash-algo to one of {', '.join(BLOCK_HASHERS)}") from None
        if not 0.0 <= self.admission_watermark < 1.0:
            raise SchedulerConfigError(
                f"admission_watermark={self.admission_watermark} must be in [0, 1); set --admission-watermark to "
                "a small fraction such as 0.01")
        if self.num_speculative_tokens < 0:
            raise SchedulerConfigError(
                f"num_speculative_tokens={self.num_speculative_tokens} must be >= 0 (0 = off); "
                "set --speculative-ngram to e.g. 3")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise SchedulerConfigError(
                f"prompt_lookup_min={self.prompt_lookup_min}, prompt_lookup_max={self.prompt_lookup_max}: need "
                "1 <= min <= max; set --ngram-prompt-lookup-min / --ngram-prompt-lookup-max (e.g. 1 and 4)")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser | Any) -> None:
        d = SchedulerConfig()
        envs.add_flag(parser, "--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                      help="tokens scheduled per step at most (prompt chunks and decodes together)")
        envs.add_flag(parser, "--max-num-seqs", type=int, default=d.max_num_seqs,
                      help="requests running at once at most")
        envs.add_flag(parser, "--long-prefill-token-threshold", type=int, default=d.long_prefill_token_threshold,
                      help="tokens one request may get per step at most; 0 = off")
        envs.add_flag(parser, "--max-decode-slowdown", type=float, default=d.max_decode_slowdown,
                      help="a step with prompt chunks may take at most this x its decodes' predicted time; 0 = off")
        envs.add_flag(parser, "--enable-prefix-caching", type=bool, default=d.enable_prefix_caching,
                      help="reuse the KV of cached full-block prefixes")
        envs.add_flag(parser, "--prefix-caching-hash-algo", default=d.prefix_caching_hash_algo,
                      choices=list(BLOCK_HASHERS),
                      help="prefix-cache block key: sha256 (steploop's) or sha256_cbor (vLLM's, for KV-event routers)")
        envs.add_flag(parser, "--kv-events-config", default="",
                      help='KV events as vLLM\'s JSON, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", '
                           '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'')
        envs.add_flag(parser, "--scheduling-policy", default=d.scheduling_policy, choices=["fcfs", "priority"],
                      help="fcfs (arrival order) or priority (lower priority value first, may preempt)")
        envs.add_flag(parser, "--async-scheduling", type=bool, default=d.async_scheduling,
                      help="plan step N+1 before step N's result arrives")
        envs.add_flag(parser, "--admission-watermark", type=float, default=d.admission_watermark,
                      help="fraction of KV blocks admissions must leave free")
        envs.add_flag(parser, "--speculative-ngram", type=int, default=d.num_speculative_tokens,
                      help="draft tokens per step from n-gram prompt lookup; 0 = off")
        envs.add_flag(parser, "--ngram-prompt-lookup-min", type=int, default=d.prompt_lookup_min,
                      help="shortest n-gram matched for drafts")
        envs.add_flag(parser, "--ngram-prompt-lookup-max", type=int, default=d.prompt_lookup_max,
                      help="longest n-gram matched for drafts")
        envs.add_flag(parser, "--max-num-encoder-input-tokens", type=int, default=d.max_num_encoder_input_tokens,
                      help="image tokens encoded per step at most (vision-language models; a tower run a slice "
                           "of layers per step counts a layer of an image as its tokens / layers); 0 = "
                           "--max-num-batched-tokens")
        envs.add_flag(parser, "--encoder-cache-size", type=int, default=d.encoder_cache_size,
                      help="image embeddings the worker's encoder cache holds at most; 0 = the larger of the encoder "
                           "budget and --max-num-batched-tokens")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "SchedulerConfig":
        try:
            kv_events = KvEventsConfig.from_json(args.kv_events_config)
        except KvEventsConfigError as err:
            raise SchedulerConfigError(str(err)) from None
        return cls(kv_events=kv_events,max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                   long_prefill_token_threshold=args.long_prefill_token_threshold,
                   max_decode_slowdown=args.max_decode_slowdown,
                   enable_prefix_caching=args.enable_prefix_caching,
                   prefix_caching_hash_algo=args.prefix_caching_hash_algo, scheduling_policy=args.scheduling_policy,
                   async_scheduling=args.async_scheduling, admission_watermark=args.admission_watermark,
                   num_speculative_tokens=args.speculative_ngram, prompt_lookup_min=args.ngram_prompt_lookup_min,
                   prompt_lookup_max=args.ngram_prompt_lookup_max,
                   max_num_encoder_input_tokens=getattr(args, "max_num_encoder_input_tokens", 0),
                   encoder_cache_size=getattr(args, "encoder_cache_size", 0))


# Module-level spellings of the same two functions.
add_cli_args = SchedulerConfig.add_cli_args
from_args = SchedulerConfig.from_args
