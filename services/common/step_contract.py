"""The per-step contract between the scheduler and a worker: one StepPlan out, one StepResult back.

These dataclasses mirror steploop.v1.StepPlan / StepResult (protos/steploop/v1/worker.proto). Scheduler and
worker use only these; `to_pb` / `from_pb` are the one place that touches the generated classes.

A plan sends deltas: a request the worker has not seen comes as a NewRequestData (in full); a request it holds
comes as one entry of CachedRequestData (handle, num_computed_tokens, new block ids) only in a step that gives it
new blocks. Otherwise it appears only in scheduled_handles: the worker advances its own num_computed_tokens, so a
decode-only step costs ~3-4 bytes per request. Requests are named by small integer handles, never by string ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from steploop.common.generation_defaults import NO_DEFAULTS, GenerationDefaults
from steploop.common.kv_moves import KvMoveReport, KvMoves
from steploop.common.pd_transfer import PdMoves, PdReport
from steploop.common.lora_adapter import LoraModelShapes
from steploop.common.lora_config import LoraModule
from steploop.common.mm_inputs import MultiModalFeature
from steploop.common.pb.steploop.v1 import engine_pb2, worker_pb2
from steploop.common.pooling_params import PoolingConfig, PoolingParams
from steploop.common.sampling_params import SamplingParams

# Trailing metadata on a plan stream the scheduler ended because it is stopping (an ordered stop, not a fault).
SCHEDULER_STOPPING_METADATA = ("steploop-scheduler-stopping", "1")


@dataclass
class NewRequestData:
    handle: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]          # non-empty only for a request resumed after preemption
    sampling: SamplingParams
    block_ids: list[int]                 # its whole block table, in order
    num_computed_tokens: int             # tokens whose KV is already in block_ids (prefix-cache hits)
    traceparent: str = ""                # W3C trace context of the scheduler's request span; "" = not traced
    pooling: PoolingParams | None = None  # set: pool the prompt once computed, sample nothing (pooling runner)
    lora_name: str = ""                  # its LoRA adapter ("" = the base model)
    mm_features: list[MultiModalFeature] = field(default_factory=list)   # its images, in prompt order

    def to_pb(self) -> worker_pb2.NewRequest:
        pb = worker_pb2.NewRequest(
            handle=self.handle, prompt_token_ids=self.prompt_token_ids, output_token_ids=self.output_token_ids,
            sampling=self.sampling.to_pb(), block_ids=self.block_ids,
            num_computed_tokens=self.num_computed_tokens, traceparent=self.traceparent, lora_name=self.lora_name,
            mm_features=[f.to_pb() for f in self.mm_features])
        if self.pooling is not None:
            pb.pooling.CopyFrom(self.pooling.to_pb())
        return pb

    @classmethod
    def from_pb(cls, pb: worker_pb2.NewRequest) -> "NewRequestData":
        return cls(handle=pb.handle, prompt_token_ids=list(pb.prompt_token_ids),
                   output_token_ids=list(pb.output_token_ids), sampling=SamplingParams.from_pb(pb.sampling),
                   block_ids=list(pb.block_ids), num_computed_tokens=pb.num_computed_tokens,
                   traceparent=pb.traceparent,
                   pooling=PoolingParams.from_pb(pb.pooling) if pb.HasField("pooling") else None,
                   lora_name=pb.lora_name, mm_features=[MultiModalFeature.from_pb(f) for f in pb.mm_features])


@dataclass
class CachedRequestData:
    """Requests the worker already holds that got new blocks this step, as parallel lists (one entry each)."""

    handles: list[int] = field(default_factory=list)              # [n]
    num_computed_tokens: list[int] = field(default_factory=list)  # [n] authoritative count from the scheduler
    new_block_ids: list[list[int]] = field(default_factory=list)  # [n][*] blocks appended to each block table

    def append(self, handle: int, num_computed_tokens: int, new_block_ids: list[int]) -> None:
        self.handles.append(handle)
        self.num_computed_tokens.append(num_computed_tokens)
        self.new_block_ids.append(new_block_ids)

    def to_pb(self) -> worker_pb2.CachedRequests:
        return worker_pb2.CachedRequests(
            handles=self.handles, num_computed_tokens=self.num_computed_tokens,
            num_new_block_ids=[len(b) for b in self.new_block_ids],
            new_block_ids=[b for blocks in self.new_block_ids for b in blocks])

    @classmethod
    def from_pb(cls, pb: worker_pb2.CachedRequests) -> "CachedRequestData":
        flat, out, pos = list(pb.new_block_ids), [], 0
        for n in pb.num_new_block_ids:
            out.append(flat[pos:pos + n])
            pos += n
        return cls(handles=list(pb.handles), num_computed_tokens=list(pb.num_computed_tokens), new_block_ids=out)


@dataclass
class StepPlan:
    step_id: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached: CachedRequestData = field(default_factory=CachedRequestData)
    # What runs this step, in batch order.
    scheduled_handles: list[int] = field(default_factory=list)      # [m]
    num_scheduled_tokens: list[int] = field(default_factory=list)   # [m] tokens each, draft tokens included
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)  # handle -> drafts to verify
    finished_handles: list[int] = field(default_factory=list)       # drop: finished or aborted
    preempted_handles: list[int] = field(default_factory=list)      # drop: preempted (come back as new)
    lora_loads: list[LoraModule] = field(default_factory=list)      # adapters to register (name, folder)
    lora_drops: list[str] = field(default_factory=list)             # adapters to forget
    kv_moves: KvMoves | None = None      # KV tier moves done before the forward (kv_moves.py); None = none
    encoder_free_hashes: list[str] = field(default_factory=list)   # encoder cache entries no request needs
    # (image hash, layers): vision-tower layers the worker runs now for a partly encoded image (encoder_budget.py)
    encoder_slices: list[tuple[str, int]] = field(default_factory=list)
    pd_moves: PdMoves | None = None      # prefill/decode transfers (pd_transfer.py); None = none
    # -pp: tokens the stages before the last append before this step (the last stage sampled them).
    stage_token_handles: list[int] = field(default_factory=list)    # [k] a handle may repeat (tokens in order)
    stage_token_ids: list[int] = field(default_factory=list)        # [k]
    # (source, destination) pool blocks to copy before the forward, after the KV moves: a beam that forks gets
    # its own copy of its parent's partial last block (copy on write, scheduler/beam_groups.py).
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def to_pb(self) -> worker_pb2.StepPlan:
        pb = worker_pb2.StepPlan(
            step_id=self.step_id, new_requests=[r.to_pb() for r in self.new_requests], cached=self.cached.to_pb(),
            scheduled_handles=self.scheduled_handles, num_scheduled_tokens=self.num_scheduled_tokens,
            finished_handles=self.finished_handles, preempted_handles=self.preempted_handles,
            lora_loads=[engine_pb2.LoraAdapterRef(name=m.name, path=m.path) for m in self.lora_loads],
            lora_drops=self.lora_drops, encoder_free_hashes=self.encoder_free_hashes,
            encoder_slice_hashes=[h for h, _ in self.encoder_slices],
            encoder_slice_layers=[n for _, n in self.encoder_slices],
            stage_token_handles=self.stage_token_handles, stage_token_ids=self.stage_token_ids)
        if self.kv_moves:
            self.kv_moves.fill_pb(pb)
        if self.pd_moves:
            self.pd_moves.fill_pb(pb)
        if self.block_copies:
            pb.kv_copy_src_blocks.extend(s for s, _ in self.block_copies)
            pb.kv_copy_dst_blocks.extend(d for _, d in self.block_copies)
        if self.draft_token_ids:
            drafts = [self.draft_token_ids.get(h, []) for h in self.scheduled_handles]
            pb.num_draft_tokens.extend(len(d) for d in drafts)
            pb.draft_token_ids.extend(t for d in drafts for t in d)
        return pb

    @classmethod
    def from_pb(cls, pb: worker_pb2.StepPlan) -> "StepPlan":
        drafts: dict[int, list[int]] = {}
        flat, pos = list(pb.draft_token_ids), 0
        for handle, n in zip(pb.scheduled_handles, pb.num_draft_tokens):
            if n:
                drafts[handle] = flat[pos:pos + n]
            pos += n
        return cls(step_id=pb.step_id, new_requests=[NewRequestData.from_pb(r) for r in pb.new_requests],
                   cached=CachedRequestData.from_pb(pb.cached), scheduled_handles=list(pb.scheduled_handles),
                   num_scheduled_tokens=list(pb.num_scheduled_tokens), draft_token_ids=drafts,
                   finished_handles=list(pb.finished_handles), preempted_handles=list(pb.preempted_handles),
                   lora_loads=[LoraModule(m.name, m.path) for m in pb.lora_loads], lora_drops=list(pb.lora_drops),
                   kv_moves=KvMoves.from_pb(pb), encoder_free_hashes=list(pb.encoder_free_hashes),
                   encoder_slices=list(zip(pb.encoder_slice_hashes, pb.encoder_slice_layers)),
                   pd_moves=PdMoves.from_pb(pb), stage_token_handles=list(pb.stage_token_handles),
                   stage_token_ids=list(pb.stage_token_ids),
                   block_copies=list(zip(pb.kv_copy_src_blocks, pb.kv_copy_dst_blocks)))


@dataclass
class TokenLogprob:
    logprob: float                       # of the sampled token
    top_token_ids: list[int] = field(default_factory=list)   # [k] most likely first
    top_logprobs: list[float] = field(default_factory=list)  # [k]
    rank: int = 0                        # prompt logprobs: 1 + tokens more likely than this one; 0 = not computed

    def to_pb(self) -> engine_pb2.TokenLogprob:
        return engine_pb2.TokenLogprob(logprob=self.logprob, top_token_ids=self.top_token_ids,
                                       top_logprobs=self.top_logprobs, rank=self.rank)

    @classmethod
    def from_pb(cls, pb: engine_pb2.TokenLogprob) -> "TokenLogprob":
        return cls(pb.logprob, list(pb.top_token_ids), list(pb.top_logprobs), pb.rank)


@dataclass(frozen=True)
class RequestFailure:
    """Why the worker cannot serve one request as asked (steploop.v1.RequestFailure). The request ends alone with
    it, as a client error; a failed step (StepResult.error) ends every request in it instead."""

    code: str                            # OpenAI-style error code, e.g. "invalid_grammar"
    message: str                         # for the client: what cannot be served and why
    param: str = ""                      # the SamplingParams field at fault ("json_schema", "regex"); "" = none


@dataclass
class StepResult:
    step_id: int
    # handle -> tokens sampled this step (1, or 1 + accepted drafts). Only requests that reached the end of
    # their known tokens sample; a request in the middle of its prompt gets no entry.
    sampled: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)  # handle -> [len(sampled[h])]
    error: str = ""                      # non-empty: the step failed, no tokens
    forward_seconds: float = 0.0
    # handle -> logprobs of prompt tokens c+1, c+2, ... where c was its num_computed_tokens at this step's start
    # (only for requests whose sampling asks for prompt_logprobs, for the prompt positions of this chunk).
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    collective_seconds: float = 0.0      # tensor parallel: this rank's time in collectives during the step
    # handle -> pooled vector of a pooling request whose whole prompt is computed as of this step.
    pooled: dict[int, list[float]] = field(default_factory=dict)
    # handle -> why it cannot be served as asked; such a request samples nothing and ends alone (the others go on).
    failed: dict[int, RequestFailure] = field(default_factory=dict)
    kv_moves: KvMoveReport | None = None   # the plan's KV tier moves: failures and time (None: none)
    pd_report: PdReport | None = None      # the plan's prefill/decode transfers (None: none)

    def to_pb(self) -> worker_pb2.StepResult:
        handles = list(self.sampled)
        pb = worker_pb2.StepResult(
            step_id=self.step_id, handles=handles, num_sampled=[len(self.sampled[h]) for h in handles],
            sampled_token_ids=[t for h in handles for t in self.sampled[h]], error=self.error,
            forward_seconds=self.forward_seconds, collective_seconds=self.collective_seconds)
        if self.logprobs:
            for h in handles:
                lps = self.logprobs.get(h) or [TokenLogprob(0.0)] * len(self.sampled[h])
                pb.logprobs.extend(lp.to_pb() for lp in lps)
        for h, lps in self.prompt_logprobs.items():
            pb.prompt_logprob_handles.append(h)
            pb.num_prompt_logprobs.append(len(lps))
            pb.prompt_logprobs.extend(lp.to_pb() for lp in lps)
        for h, vector in self.pooled.items():
            pb.pooled_handles.append(h)
            pb.pooled_dims.append(len(vector))
            pb.pooled_values.extend(vector)
        for h, failure in self.failed.items():
            pb.request_failures.add(handle=h, code=failure.code, message=failure.message, param=failure.param)
        if self.kv_moves is not None:
            self.kv_moves.fill_pb(pb)
        if self.pd_report is not None:
            self.pd_report.fill_pb(pb)
        return pb

    @classmethod
    def from_pb(cls, pb: worker_pb2.StepResult) -> "StepResult":
        sampled, logprobs, pos = {}, {}, 0
        flat = list(pb.sampled_token_ids)
        for handle, n in zip(pb.handles, pb.num_sampled):
            sampled[handle] = flat[pos:pos + n]
            if pb.logprobs:
                logprobs[handle] = [TokenLogprob.from_pb(x) for x in pb.logprobs[pos:pos + n]]
            pos += n
        prompt_logprobs, pos = {}, 0
        for handle, n in zip(pb.prompt_logprob_handles, pb.num_prompt_logprobs):
            prompt_logprobs[handle] = [TokenLogprob.from_pb(x) for x in pb.prompt_logprobs[pos:pos + n]]
            pos += n
        pooled, pos, values = {}, 0, list(pb.pooled_values)
        for handle, n in zip(pb.pooled_handles, pb.pooled_dims):
            pooled[handle] = values[pos:pos + n]
            pos += n
        failed = {f.handle: RequestFailure(f.code, f.message, f.param) for f in pb.request_failures}
        return cls(step_id=pb.step_id, sampled=sampled, logprobs=logprobs, error=pb.error,
                   forward_seconds=pb.forward_seconds, prompt_logprobs=prompt_logprobs, pooled=pooled,
                   collective_seconds=pb.collective_seconds, failed=failed, kv_moves=KvMoveReport.from_pb(pb),
                   pd_report=PdReport.from_pb(pb))


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker says about itself when it attaches (steploop.v1.WorkerHello)."""

    worker_id: str
    model_name: str
    block_size: int
    num_kv_blocks: int                   # block 0 included (the scheduler keeps it as the null block)
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    rank: int = 0
    world_size: int = 1
    runner: str = "generate"             # "generate" or "pooling" (embeddings)
    pooling: PoolingConfig | None = None  # how it pools (runner "pooling" only)
    generation_defaults: GenerationDefaults = NO_DEFAULTS   # the model's sampling defaults (--generation-config)
    dtype: str = ""                      # e.g. "float32"; the ranks of a group must agree
    tp_rendezvous: str = ""              # rank 0 of a group: host:port of its process-group store
    lora_shapes: LoraModelShapes | None = None   # with --enable-lora: what an adapter must fit
    expert_parallel: bool = False        # --enable-expert-parallel; the ranks of a group must agree
    pipeline_parallel_size: int = 1      # -pp: world_size is tp x pp; the last stage's tp rank 0 answers with tokens
    kv_host_blocks: int = 0              # KV tiers below the pool (--kv-offloading-size, --kv-disk-size), in blocks
    kv_disk_blocks: int = 0
    kv_disk_hashes: tuple[bytes, ...] = ()   # block hashes on disk for this model's fingerprint, LRU first
    kv_block_bytes: int = 0              # bytes of one block over all layers
    kv_role: str = ""                    # --kv-role: "" (everything), "prefill" or "decode" (pd_disagg.py)
    kv_transfer_address: str = ""        # a decode worker's block receiver, host:port
    kv_transfer_block_bytes: int = 0     # one block as transfers carry it (every KV head); 0: kv_block_bytes
    kv_cache_dtype: str = ""             # what the KV cache stores (--kv-cache-dtype); "": the same as dtype
    accepts_images: bool = False         # a vision-language model (requests may carry images)
    images_whole: bool = False           # its images attend both ways (Gemma 3): chunks never end inside one
    encoder_layers: int = 0              # its vision tower's layers, run a slice at a time; 0: whole images only

    @property
    def cache_dtype(self) -> str:
        return self.kv_cache_dtype or self.dtype

    @property
    def transfer_block_bytes(self) -> int:
        """Bytes of one block on a P/D or pull link (every KV head, whatever the group's -tp)."""
        return self.kv_transfer_block_bytes or self.kv_block_bytes

    @property
    def answer_rank(self) -> int:
        """The rank whose step results carry the tokens: the last pipeline stage's tensor-parallel rank 0."""
        return self.world_size - self.world_size // self.pipeline_parallel_size

    def to_pb(self) -> worker_pb2.WorkerHello:
        pb = worker_pb2.WorkerHello(
            worker_id=self.worker_id, rank=self.rank, world_size=self.world_size, model_name=self.model_name,
            block_size=self.block_size, num_kv_blocks=self.num_kv_blocks, max_model_len=self.max_model_len,
            vocab_size=self.vocab_size, eos_token_ids=list(self.eos_token_ids), runner=self.runner,
            generation_defaults=self.generation_defaults.to_pb(), dtype=self.dtype, tp_rendezvous=self.tp_rendezvous,
            expert_parallel=self.expert_parallel, pipeline_parallel_size=self.pipeline_parallel_size,
            kv_host_blocks=self.kv_host_blocks, kv_disk_blocks=self.kv_disk_blocks,
            kv_disk_hashes=list(self.kv_disk_hashes), kv_block_bytes=self.kv_block_bytes,
            accepts_images=self.accepts_images,
            images_whole=self.images_whole, encoder_layers=self.encoder_layers, kv_role=self.kv_role, kv_transfer_address=self.kv_transfer_address,
            kv_transfer_block_bytes=self.kv_transfer_block_bytes, kv_cache_dtype=self.kv_cache_dtype)
        if self.pooling is not None:
            pb.pooling.CopyFrom(self.pooling.to_pb())
        if self.lora_shapes is not None:
            shapes = self.lora_shapes
            pb.lora_shapes.CopyFrom(worker_pb2.LoraModelShapes(
                num_layers=shapes.num_layers, targets=list(shapes.targets),
                in_features=[i for i, _ in shapes.targets.values()],
                out_features=[o for _, o in shapes.targets.values()]))
        return pb

    @classmethod
    def from_pb(cls, pb: worker_pb2.WorkerHello) -> "WorkerInfo":
        shapes = None
        if pb.HasField("lora_shapes"):
            s = pb.lora_shapes
            shapes = LoraModelShapes(s.num_layers, {t: (i, o) for t, i, o in zip(s.targets, s.in_features,
                                                                                 s.out_features)})
        return cls(worker_id=pb.worker_id, model_name=pb.model_name, block_size=pb.block_size,
                   num_kv_blocks=pb.num_kv_blocks, max_model_len=pb.max_model_len, vocab_size=pb.vocab_size,
                   eos_token_ids=tuple(pb.eos_token_ids), rank=pb.rank, world_size=pb.world_size,
                   runner=pb.runner or "generate",
                   pooling=PoolingConfig.from_pb(pb.pooling) if pb.HasField("pooling") else None,
                   generation_defaults=GenerationDefaults.from_pb(pb.generation_defaults),
                   dtype=pb.dtype, tp_rendezvous=pb.tp_rendezvous, lora_shapes=shapes,
                   expert_parallel=pb.expert_parallel, pipeline_parallel_size=pb.pipeline_parallel_size or 1,
                   kv_host_blocks=pb.kv_host_blocks, kv_disk_blocks=pb.kv_disk_blocks,
                   kv_disk_hashes=tuple(pb.kv_disk_hashes), kv_block_bytes=pb.kv_block_bytes,
                   accepts_images=pb.accepts_images,
                   images_whole=pb.images_whole, encoder_layers=pb.encoder_layers, kv_role=pb.kv_role, kv_transfer_address=pb.kv_transfer_address,
                   kv_transfer_block_bytes=pb.kv_transfer_block_bytes, kv_cache_dtype=pb.kv_cache_dtype)
