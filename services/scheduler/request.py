"""A request as the scheduler sees it: token ids, counters and a status. No text, no transport."""

from __future__ import annotations

import enum
import time
from dataclasses import KW_ONLY, dataclass, field

from steploop.common.beam_ranking import BeamConfig
from steploop.common.mm_inputs import MultiModalFeature
from steploop.common.pooling_params import PoolingParams
from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import TokenLogprob


class RequestStatus(enum.IntEnum):
    """Order matters: every finished state comes after PREEMPTED, so `is_finished` is one comparison."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()   # EOS or a stop token id
    FINISHED_LENGTH = enum.auto()    # max_tokens or max_model_len
    FINISHED_ABORTED = enum.auto()   # client cancelled
    FINISHED_ERROR = enum.auto()     # the worker failed the step
    FINISHED_REJECTED = enum.auto()  # the worker cannot serve it as asked (e.g. its grammar does not compile)

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


@dataclass(eq=False, slots=True)
class Request:
    # slots, and the fields the per-step loops read (running_pass.py, step_update.py, fastpath/decode_loop.c) first: at 1024+ running
    # requests those loops wait on memory, and these then share two cache lines instead of four. Everything after
    # the first two is keyword-only: the order below is layout, not an API.
    request_id: str
    prompt_token_ids: list[int]
    _: KW_ONLY
    status: RequestStatus = RequestStatus.WAITING
    handle: int = -1                     # small int the worker knows it by; assigned by the scheduler
    num_computed_tokens: int = 0         # tokens whose KV is in this request's blocks
    # Async scheduling: tokens sampled by steps in flight that this scheduler has not seen yet (0 or 1; always 0
    # under synchronous scheduling, so the gap reads it either way).
    num_output_placeholders: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    # Set by add_request, so the per-step loops touch neither the prompt list nor the sampling params:
    # len(prompt_token_ids) (a prompt never changes) and whether sampling asks for prompt logprobs.
    num_prompt: int = 0
    # The stop rule, also written by add_request (stop_rule.py: the one encoding Python and C read): the output
    # length at which it stops (max_tokens or the context, whichever first), the ids that may stop it (its
    # stop_token_ids, and EOS unless ignore_eos) and the output length before which they do not (min_tokens).
    max_output_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens to verify next step
    stop_ids: frozenset[int] = frozenset()
    min_output_tokens: int = 0
    sends_prompt_logprobs: bool = False
    num_cached_tokens: int = 0           # of the prompt, found in the prefix cache (reported in usage)
    sampling: SamplingParams = field(default_factory=SamplingParams)  # max_tokens resolved by add_request
    priority: int = 0                    # lower runs first (vLLM's convention); used by later policies
    background: bool = False             # Batch API work: ranked after every interactive request (policy.py)
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None        # isolates this request's prefix-cache entries (mixed into block 0's key)
    lora_name: str | None = None         # its LoRA adapter (None: the base model); also in block 0's key
    lora_path: str = ""                  # the adapter's folder, resolved when the request arrived
    stop_token_id: int | None = None     # the EOS / stop id that finished it, if any
    num_preemptions: int = 0
    # Prefix-cache keys of this request's full blocks, in order; content-derived, so kept across preemptions.
    block_hashes: list[bytes] = field(default_factory=list)
    error: str = ""                      # set with FINISHED_ERROR and FINISHED_REJECTED
    # sampling.prompt_logprobs: logprobs of prompt tokens 1, 2, ... gathered over the prompt's chunks; sent
    # with the first output. Kept across preemption (the recomputed ones are dropped).
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # An embedding request: prompt only, finished (FINISHED_STOPPED, nothing sampled) with the worker's pooled
    # vector once the whole prompt is computed. no_prefix_hits: its pooling needs every prompt position (MEAN, CLS).
    pooling: PoolingParams | None = None
    no_prefix_hits: bool = False
    # Its images (vision-language models), in prompt order: placeholder ranges, hashes and pixels for the worker.
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    # Set: a beam search request (beam_groups.py): never queued itself, its beams are.
    beam: BeamConfig | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)


class RequestRejectedError(ValueError):
    """add_request refused a request that could never run. `code` is the OpenAI-style error code, `param` the
    request field at fault."""

    def __init__(self, message: str, code: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.code = code                 # "context_length_exceeded", "kv_cache_too_small" or "invalid_value"
        self.param = param               # "prompt", "max_tokens" or "min_tokens"


@dataclass(slots=True)
class RequestOutput:
    """What one step (or an abort) produced for one request; the server turns it into a GenerateChunk."""

    request_id: str
    new_token_ids: list[int]             # [k] appended this step, truncated after a stop
    logprobs: list[TokenLogprob] | None  # [k] when the worker sent them
    finish_reason: RequestStatus | None  # None while running; a FINISHED_* status once done
    stop_token_id: int | None            # the EOS / stop id that finished it (FINISHED_STOPPED)
    num_prompt_tokens: int
    num_output_tokens: int               # total so far, new_token_ids included
    num_cached_tokens: int               # prompt tokens served from the prefix cache
    error: str = ""                      # why, for FINISHED_ERROR
    prompt_logprobs: list[TokenLogprob] | None = None  # [num_prompt_tokens - 1], on the first output only
    embedding: list[float] | None = None  # a pooling request's vector, on its one (last) output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
