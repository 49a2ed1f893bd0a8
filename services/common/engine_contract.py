"""The Engine seam's contract: one EngineRequest in, a stream of EngineChunks back (steploop.v1.Engine).

These dataclasses mirror steploop.v1.GenerateRequest / GenerateChunk (protos/steploop/v1/engine.proto), as
step_contract.py mirrors the worker seam. The scheduler's EngineLoop and the gateway's generation use only these;
`to_pb` / `from_pb` are the one place that touches the generated classes, and only the servicers
(scheduler/servicers.py, session.py) and the engine client (gateway/engine/engine_client.py, engine_session.py) call
them. A chunk is converted once per request per step on both sides, so they are slots dataclasses filled field by
field, and only the first chunk with tokens and the last carry a Usage.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from steploop.common.beam_ranking import BeamConfig, Hypothesis
from steploop.common.generation_defaults import NO_DEFAULTS, GenerationDefaults
from steploop.common.kv_pull import KvPullHint
from steploop.common.mm_inputs import MultiModalFeature
from steploop.common.pb.steploop.v1 import engine_pb2
from steploop.common.pooling_params import PoolingConfig, PoolingParams
from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import TokenLogprob


class FinishReason(enum.IntEnum):
    """Why a request ended; the values are steploop.v1.FinishReason's, so the wire value converts by index."""

    NONE = 0                 # not finished yet (FINISH_REASON_UNSPECIFIED)
    STOP = 1                 # EOS or a stop token id
    LENGTH = 2               # max_tokens or the model's context length
    ABORT = 3                # cancelled by the caller or the server
    ERROR = 4                # the forward pass failed for this request
    REJECTED = 5             # it cannot be served as asked (a client error): error_message / _code / _param say why


_FINISH_BY_VALUE = tuple(FinishReason)   # wire value -> FinishReason, without an enum call per chunk

# WatchKVEvents' initial metadata: "1" when the scheduler resumes the watcher's (instance_id, from_sequence), so
# only missed batches follow and the watcher's index is whole again at once; "0" when a snapshot comes first.
KV_EVENTS_RESUMED_METADATA = "steploop-kv-events-resumed"


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One generation (or embedding) request as it crosses the Engine seam: the gateway builds it once per choice
    and hands it down its generate chain unchanged (generation -> router -> migration -> engine client; a
    migrated retry is a `dataclasses.replace` of it); the scheduler's servicers build it from the wire."""

    request_id: str                      # unique per live request; "" = the engine assigns one (Generate only)
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0                    # lower runs first under --scheduling-policy priority
    cache_salt: str = ""                 # mixed into the first prefix-cache block hash (tenant isolation)
    pooling: PoolingParams | None = None  # set: an embedding request (prompt only; the chunk carries a vector)
    # Migration: outputs another engine already delivered; this one continues after them (engine.proto).
    resume_output_token_ids: list[int] = field(default_factory=list)
    lora_name: str = ""                  # the LoRA adapter to run with; "" = the base model
    mm_features: list[MultiModalFeature] = field(default_factory=list)   # its images (vision-language models)
    background: bool = False             # Batch API work: yields to interactive requests under every policy
    disaggregation: str = ""             # "" (the scheduler's rule), "disaggregated" or "local" (pd_disagg.py)
    beam: BeamConfig | None = None       # set: beam search in the scheduler; the last chunk carries `beams`
    kv_pull: KvPullHint | None = None    # another replica caches its prefix: pull it from there (common/kv_pull.py)

    def to_pb(self) -> engine_pb2.GenerateRequest:
        pb = engine_pb2.GenerateRequest(request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
                                        sampling=self.sampling.to_pb(), priority=self.priority,
                                        cache_salt=self.cache_salt, lora_name=self.lora_name,
                                        resume_output_token_ids=self.resume_output_token_ids,
                                        mm_features=[f.to_pb() for f in self.mm_features],
                                        background=self.background,
                                        disaggregation=self.disaggregation)
        if self.pooling is not None:
            pb.pooling.CopyFrom(self.pooling.to_pb())
        if self.beam is not None:
            pb.beam_search.CopyFrom(beam_config_to_pb(self.beam))
        if self.kv_pull is not None:
            pb.kv_pull.CopyFrom(self.kv_pull.to_pb())
        return pb

    @classmethod
    def from_pb(cls, pb: engine_pb2.GenerateRequest) -> "EngineRequest":
        return cls(pb.request_id, list(pb.prompt_token_ids), SamplingParams.from_pb(pb.sampling), pb.priority,
                   pb.cache_salt, PoolingParams.from_pb(pb.pooling) if pb.HasField("pooling") else None,
                   list(pb.resume_output_token_ids), pb.lora_name,
                   [MultiModalFeature.from_pb(f) for f in pb.mm_features], pb.background,
                   pb.disaggregation, beam_config_from_pb(pb.beam_search) if pb.HasField("beam_search") else None,
                   KvPullHint.from_pb(pb.kv_pull) if pb.HasField("kv_pull") else None)


@dataclass(slots=True)
class Usage:
    """Token counts of one request (steploop.v1.Usage); the gateway sums choices' into the OpenAI usage."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0               # prompt tokens served from the prefix cache

    def to_pb(self, pb: engine_pb2.Usage | None = None) -> engine_pb2.Usage:
        """Fills pb (a chunk's `usage` in place), or a new Usage."""
        if pb is None:
            pb = engine_pb2.Usage()
        pb.prompt_tokens, pb.completion_tokens, pb.cached_tokens = (self.prompt_tokens, self.completion_tokens,
                                                                    self.cached_tokens)
        return pb

    @classmethod
    def from_pb(cls, pb: engine_pb2.Usage) -> Usage:
        return cls(pb.prompt_tokens, pb.completion_tokens, pb.cached_tokens)


@dataclass(slots=True)
class EngineChunk:
    """New tokens of one request since its previous chunk. The last chunk has finish_reason set and usage."""

    token_ids: list[int]
    logprobs: Sequence[TokenLogprob] = ()         # [len(token_ids)] when logprobs were asked for
    finish_reason: FinishReason = FinishReason.NONE
    stop_token_id: int = 0               # the token id that stopped it (STOP)
    usage: Usage | None = None           # so far: on the first chunk with tokens and on the last
    error_message: str = ""              # why, for ERROR
    # Logprobs of prompt tokens 1 .. P-1, in the first chunk that carries a token, when prompt_logprobs was set.
    prompt_logprobs: Sequence[TokenLogprob] = ()
    embedding: Sequence[float] = ()      # a pooling request's vector, in its last chunk
    error_code: str = ""                 # REJECTED: the OpenAI error code (e.g. "invalid_grammar")
    error_param: str = ""                # REJECTED: the SamplingParams field at fault ("json_schema", "regex")
    beams: Sequence[Hypothesis] = ()     # a beam search request's hypotheses, best first, in its last chunk

    @property
    def finished(self) -> bool:
        return self.finish_reason != FinishReason.NONE

    def to_pb(self, pb: engine_pb2.GenerateChunk | None = None) -> engine_pb2.GenerateChunk:
        """Fills pb (a SessionChunk's `chunk` in place), or a new GenerateChunk."""
        if pb is None:
            pb = engine_pb2.GenerateChunk()
        pb.token_ids.extend(self.token_ids)
        if self.logprobs:
            pb.logprobs.extend([lp.to_pb() for lp in self.logprobs])
        if self.prompt_logprobs:
            pb.prompt_logprobs.extend([lp.to_pb() for lp in self.prompt_logprobs])
        if self.embedding:
            pb.embedding.extend(self.embedding)
        if self.finish_reason:
            pb.finish_reason = self.finish_reason
            pb.stop_token_id = self.stop_token_id
            pb.error_message = self.error_message
            pb.error_code = self.error_code
            pb.error_param = self.error_param
            if self.beams:
                pb.beams.extend(hypothesis_to_pb(h) for h in self.beams)
        if self.usage is not None:
            self.usage.to_pb(pb.usage)
        return pb

    @classmethod
    def from_pb(cls, pb: engine_pb2.GenerateChunk, with_logprobs: bool = True) -> "EngineChunk":
        """with_logprobs=False: the request asked for neither kind, so they are not looked for (each look at a
        repeated message field builds a wrapper, and this runs for every token the gateway streams)."""
        finish = _FINISH_BY_VALUE[pb.finish_reason]
        if not with_logprobs:
            if not finish:   # the per-token case
                return cls(list(pb.token_ids), usage=Usage.from_pb(pb.usage) if pb.HasField("usage") else None)
            logprobs = prompt_logprobs = ()
        else:
            logprobs = [TokenLogprob.from_pb(x) for x in pb.logprobs]
            prompt_logprobs = [TokenLogprob.from_pb(x) for x in pb.prompt_logprobs]
            if not finish:
                usage = Usage.from_pb(pb.usage) if pb.HasField("usage") else None
                return cls(list(pb.token_ids), logprobs, usage=usage, prompt_logprobs=prompt_logprobs)
        return cls(list(pb.token_ids), logprobs, finish, pb.stop_token_id, Usage.from_pb(pb.usage), pb.error_message,
                   prompt_logprobs, list(pb.embedding) if pb.embedding else (), pb.error_code, pb.error_param,
                   [hypothesis_from_pb(h) for h in pb.beams] if len(pb.beams) else ())


_BEAM_FINISH = {"stop": 1, "length": 2}     # FinishReason.STOP / LENGTH on the wire
_EARLY = {True: "true", False: "false", "never": "never"}


def beam_config_to_pb(config: BeamConfig) -> engine_pb2.BeamSearchParams:
    return engine_pb2.BeamSearchParams(width=config.width, length_penalty=config.length_penalty,
                                       early_stopping=_EARLY[config.early_stopping])


def beam_config_from_pb(pb: engine_pb2.BeamSearchParams) -> BeamConfig:
    early = {"true": True, "false": False, "": False, "never": "never"}.get(pb.early_stopping)
    if early is None:
        raise ValueError(f"beam_search.early_stopping must be 'true', 'false' or 'never', got {pb.early_stopping!r}")
    return BeamConfig(pb.width, pb.length_penalty, early)


def hypothesis_to_pb(h: Hypothesis) -> engine_pb2.BeamHypothesis:
    return engine_pb2.BeamHypothesis(token_ids=h.tokens, logprobs=[lp.to_pb() for lp in h.logprobs],
                                     cum_logprob=h.cum_logprob, score=h.score,
                                     finish_reason=_BEAM_FINISH[h.finish_reason])


def hypothesis_from_pb(pb: engine_pb2.BeamHypothesis) -> Hypothesis:
    reason = "stop" if pb.finish_reason == 1 else "length"
    return Hypothesis(list(pb.token_ids), pb.cum_logprob, pb.score, reason,
                      [TokenLogprob.from_pb(x) for x in pb.logprobs])


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What model is served and how big its context and KV pool are (steploop.v1.ModelInfo)."""

    model_name: str = ""
    max_model_len: int = 0               # prompt + completion tokens at most; 0 while no worker is attached
    vocab_size: int = 0
    block_size: int = 0                  # tokens per KV block (prefix-cache keys cover whole blocks)
    num_kv_blocks: int = 0
    eos_token_ids: tuple[int, ...] = ()
    num_workers: int = 0                 # attached now
    runner: str = ""                     # "generate" or "pooling"; "" while no worker is attached
    pooling: PoolingConfig | None = None  # how it pools (runner "pooling" only)
    generation_defaults: GenerationDefaults = NO_DEFAULTS   # the model's sampling defaults
    lora_adapters: tuple[tuple[str, str], ...] = ()   # (name, folder) of each LoRA adapter served
    max_waiting: int = 0                 # the replica's --max-waiting; 0 = not said (an older scheduler)
    kv_block_bytes: int = 0              # bytes of one KV block (the router's pull cost); 0: not known

    @classmethod
    def from_pb(cls, pb: engine_pb2.ModelInfo) -> "ModelInfo":
        return cls(pb.model_name, pb.max_model_len, pb.vocab_size, pb.block_size, pb.num_kv_blocks,
                   tuple(pb.eos_token_ids), pb.num_workers, pb.runner,
                   PoolingConfig.from_pb(pb.pooling) if pb.HasField("pooling") else None,
                   GenerationDefaults.from_pb(pb.generation_defaults),
                   tuple((a.name, a.path) for a in pb.lora_adapters), pb.max_waiting, pb.kv_block_bytes)

    def to_pb(self) -> engine_pb2.ModelInfo:
        return engine_pb2.ModelInfo(
            model_name=self.model_name, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            block_size=self.block_size, num_kv_blocks=self.num_kv_blocks, eos_token_ids=self.eos_token_ids,
            num_workers=self.num_workers, max_waiting=self.max_waiting, runner=self.runner,
            pooling=self.pooling.to_pb() if self.pooling is not None else None,
            generation_defaults=self.generation_defaults.to_pb(),
            lora_adapters=[engine_pb2.LoraAdapterRef(name=name, path=path) for name, path in self.lora_adapters],
            kv_block_bytes=self.kv_block_bytes)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """Queue lengths and KV usage, for routers and autoscalers (steploop.v1.LoadReport). The scheduler's own
    report (scheduler/stats.py EngineLoad) extends it with what stays in the service."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_cache_usage: float = 0.0          # 0..1, as vllm:kv_cache_usage_perc
    num_steps: int = 0                   # steps run since start
    running_lora_adapters: tuple[str, ...] = ()   # adapters of running requests (the router prefers these)
    waiting_lora_adapters: tuple[str, ...] = ()

    @classmethod
    def from_pb(cls, pb: engine_pb2.LoadReport) -> "LoadReport":
        return cls(pb.num_running, pb.num_waiting, pb.num_free_blocks, pb.num_total_blocks, pb.kv_cache_usage,
                   pb.num_steps, tuple(pb.running_lora_adapters), tuple(pb.waiting_lora_adapters))

    def to_pb(self) -> engine_pb2.LoadReport:
        return engine_pb2.LoadReport(
            num_running=self.num_running, num_waiting=self.num_waiting, num_free_blocks=self.num_free_blocks,
            num_total_blocks=self.num_total_blocks, kv_cache_usage=self.kv_cache_usage, num_steps=self.num_steps,
            running_lora_adapters=self.running_lora_adapters, waiting_lora_adapters=self.waiting_lora_adapters)
