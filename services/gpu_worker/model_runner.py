"""ModelRunner: one StepPlan in, one StepResult out. Owns the model, the KV cache and the persistent batch.

    execute(plan): apply the plan's deltas -> build inputs -> forward -> logits for the rows that sample
                   -> sample (and verify drafts) -> append the sampled tokens to the worker's own lists

The worker appends what it sampled itself, so under async scheduling step N+1 can use step N's token before the
scheduler has seen it. A failing step returns StepResult(error=...) instead of raising; a request that cannot be
served as asked (a grammar that does not compile) fails alone, in StepResult.failed.
"""

from __future__ import annotations

import logging
import pathlib
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from steploop.common.model_path import served_model_name
from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import StepPlan, StepResult, TokenLogprob, WorkerInfo
from steploop.gpu_worker import kv_block_copy, kv_cache, kv_cache_dtype, kv_tier_mover, kv_transfer
from steploop.gpu_worker.attention.selector import create_backend
from steploop.gpu_worker.capture_plan import graph_plan
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.cpu_kernels.thread_governor import ThreadGovernor, make_thread_governor
from steploop.gpu_worker.cpu_kernels.threads import granted_cpus
from steploop.gpu_worker.cuda_graphs import StepGraphRunner
from steploop.gpu_worker.distributed.comm import CollectiveError
from steploop.gpu_worker.distributed.rank_setup import RankSetup
from steploop.gpu_worker.distributed.stored_split import check_stored_split
from steploop.gpu_worker.encoder_cache import EncoderCache
from steploop.gpu_worker.generation_config import generation_eos_ids, read_generation_defaults
from steploop.gpu_worker.gguf.weights import gguf_source
from steploop.gpu_worker.input_batch import InputBatch
from steploop.gpu_worker.kv_heads import KvHeads
from steploop.gpu_worker.kernel_plan import resolve_kernel_plan
from steploop.gpu_worker.kv_tier_mover import KvTierMover, model_identity
from steploop.gpu_worker.logits_processors import LogitsEdits
from steploop.gpu_worker.lora.manager import LoraManager
from steploop.gpu_worker.memory_profile import (
    graph_pool_bytes,
    lora_slot_bytes,
    nccl_bytes,
    profile_sequences,
    split_partials_bytes,
)
from steploop.gpu_worker.model.llama import LlamaForCausalLM
from steploop.gpu_worker.model.half_weights import holds_16bit
from steploop.gpu_worker.model.loader import load_model, safetensors_files
from steploop.gpu_worker.model.model_config import LlamaModelConfig
from steploop.gpu_worker.penalties import PenaltyInputs
from steploop.gpu_worker.pooling import Pooler, has_sentence_transformers_config, load_pooling_config
from steploop.gpu_worker.prompt_logprobs import plan_prompt_logprob_rows
from steploop.gpu_worker.sleep_mode import SleepMode
from steploop.gpu_worker.sampler import HostSamplerOutput, Sampler, SamplingMetadata, StagedSampling
from steploop.gpu_worker.staging import StagingBuffer, StepStaging
from steploop.gpu_worker.step_inputs import SamplingSlot, StepInputs, stage_step_inputs
from steploop.gpu_worker.step_overlap import LaunchedStep, keeps_step_in_flight, may_follow, placeholder
from steploop.gpu_worker.structured_output import StructuredOutput
from steploop.gpu_worker.weight_update import WeightUpdater

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], block_size: int,
                 max_model_len: int, info: WorkerInfo, seed: int = 0, structured: StructuredOutput | None = None,
                 graphs: StepGraphRunner | None = None, pooler: Pooler | None = None,
                 lora: LoraManager | None = None):
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.max_model_len, self.info = max_model_len, info
        self.device = kv_caches[0].device
        self.vocab_size = model.config.vocab_size
        self.batch = InputBatch(self.device, -(-max_model_len // block_size))
        self.staging = StagingBuffer(self.device)    # the step's one host-to-device copy (staging.py)
        plan = getattr(model, "plan", None)
        self.sampler = Sampler(seed, self.device, plan.ops.argmax_rows if plan is not None else None)
        self.graphs = graphs             # steps replay CUDA graphs when set (capture_plan.py says which)
        self.pooler = pooler             # --runner pooling: steps pool hidden states instead of sampling
        self.structured = structured or StructuredOutput(None, self.vocab_size)   # None: no tokenizer folder
        self.tp_comm = getattr(model, "tp_comm", None)   # a tensor-parallel rank's collectives, else None
        self.pipe = getattr(model, "pipe", None)         # a pipeline stage's link to the others, else None
        self.lora = lora                 # --enable-lora: adapters per request (lora/manager.py)
        self.threads: ThreadGovernor | None = None   # CPU: each step's thread count from measured step times
        self.weights: WeightUpdater | None = None   # /update_weights_from_disk (weight_update.py); from_config sets it
        self.sleep_mode: SleepMode | None = None     # /sleep, /wake_up (sleep_mode.py); from_config sets it
        self.receiver = None     # update_weights_from_distributed (weight_receiver.py); from_config sets it
        self.tiers: KvTierMover | None = None        # KV tiers below the pool (kv_tier_mover.py)
        self.kv_sender = None        # --kv-role prefill: sends prompts' blocks after the forward (kv_transfer.py)
        self.kv_receiver = None      # --kv-role decode: stages received blocks for the plans to claim (rank 0)
        self.kv_heads = None         # --kv-role: which KV heads each rank of the group holds (kv_heads.py)
        self.kernel_tuning: dict | None = None     # CUDA + triton: the launch configs chosen and variants warmed
        # vision-language models: images, M-RoPE positions and the encoder cache (encoder_cache.py)
        self.encoder = EncoderCache(model, self.device) if getattr(model.config, "is_multimodal", False) else None
        self.keep_in_flight = False      # launch step N+1 before finishing step N (step_overlap.py); from_config
        self.in_flight: LaunchedStep | None = None
        self._in_flight_tokens: torch.Tensor | None = None   # while launching: the in-flight step's sampled tokens

    @classmethod
    def from_config(cls, config: WorkerConfig, model_path: pathlib.Path) -> ModelRunner:
        """Resolve the kernel plan, build and load the model from it, size and allocate the KV cache, bind it."""
        device = torch.device(config.resolved_device())
        dtype = config.resolved_dtype(device.type)
        if device.type == "cpu":
            torch.set_num_threads(config.num_threads or granted_cpus())
        elif device.index is not None:
            torch.cuda.set_device(device)   # Triton launches, graph captures and NCCL use the current device
        cfg = LlamaModelConfig.from_dir(model_path)
        if cfg.model_type == "gemma3" and device.type != "cpu":
            raise ValueError("gemma3 with images runs on the CPU only for now: its image tokens attend to each other "
                             "both ways, a mask the Triton / CUDA-graph attention path does not apply (serve the "
                             "text-only checkpoint as gemma3_text on CUDA, or run this one with --device cpu)")
        rank = RankSetup.for_worker(config, cfg)    # refuses shapes that cannot split, before weights load
        check_stored_split(model_path, cfg, rank.share)     # and quantized layers cut off their blocks / groups
        pooling = (load_pooling_config(model_path, cfg.hidden_size) if config.runner == "pooling" or
                   (config.runner == "auto" and has_sentence_transformers_config(model_path)) else None)
        defaults = read_generation_defaults(config.generation_config, model_path)
        eos_ids = generation_eos_ids(config.generation_config, model_path, cfg.eos_token_ids)
        max_len = _max_model_len(config, cfg)
        gguf = gguf_source(model_path) is not None
        stored_quantized = cfg.quant is not None or gguf
        # a bf16 / fp16 checkpoint is read at its width too (model/half_weights.py): like quantized weights, no
        # start-up probe weighs it against an fp32 copy it would first have to double into
        half = not stored_quantized and holds_16bit(safetensors_files(model_path))
        plan = rank.kernel_plan(resolve_kernel_plan(config, device, dtype, rank.local_cfg, stored_quantized or half),
                                gguf, half)
        log.info("kernel plan: %s", plan.describe())
        local = rank.local_cfg
        backend = create_backend(plan.attention_backend, local.num_attention_heads, local.num_key_value_heads,
                                 local.head_dim, local.head_dim ** -0.5, plan.cpu_attention_kernel)
        kv_dtype = kv_cache_dtype.resolve(config.kv_cache_dtype, dtype)
        if kv_cache_dtype.is_fp8(kv_dtype) and not backend.supports_fp8_kv:
            raise ValueError(f"--kv-cache-dtype {config.kv_cache_dtype}: only the Triton attention kernels read an "
                             f"FP8 KV cache (CUDA); this worker runs the {plan.attention_backend} backend on "
                             f"{device.type}, whose kernels read a {str(dtype).removeprefix('torch.')} cache. "
                             "Use --kv-cache-dtype auto")
        start = time.perf_counter()
        log.info("loading model %s (%d layers, %s on %s)", model_path, cfg.num_hidden_layers,
                 str(dtype).removeprefix("torch."), device)
        model = load_model(model_path, backend, max_len, dtype, device, plan, rank.share, rank.comm, rank.stage,
                           rank.pipe)
        log.info("loaded %s in %.2f s: %.1f M params, %s on %s, max_model_len %d", model_path,
                 time.perf_counter() - start, _num_params(model) / 1e6,
                 str(dtype).removeprefix("torch."), device, max_len)
        _set_int8_activations(config.cpu_int8_activations, model, plan)
        profile = _cuda_profile(model, config, local, max_len, dtype, device, plan)
        for comm in rank.comms:           # the memory profile runs before the group exists: shapes only
            comm.local_only = True
        num_blocks = kv_cache.decide_num_blocks(config, local, max_len, kv_dtype, device, profile)
        for comm in rank.comms:
            comm.local_only = False
        caches = kv_cache.allocate_kv_caches(local, num_blocks, config.block_size, kv_dtype, device, plan.hugepages)
        _set_kv_scales(model, backend, kv_dtype, len(caches), device)
        log.info("decode steps: %s", model.bind_kv_caches(caches))
        if cfg.is_multimodal and (pooling is not None or config.lora.enable_lora):
            raise ValueError(f"{cfg.model_type}: a vision-language model runs --runner generate without "
                             "--enable-lora (pooling and LoRA over image inputs are not implemented)")
        if config.lora.enable_lora and pooling is not None:
            raise ValueError("--enable-lora serves generate models; this worker runs --runner pooling (embeddings)")
        lora = LoraManager.build(model, config.lora, dtype, device) if config.lora.enable_lora else None
        model.lora = lora.layers if lora is not None else None
        tiers = kv_tier_mover.build(config, caches, model_identity(model_path), kv_dtype, plan.describe())
        info = WorkerInfo(worker_id=config.resolved_worker_id, model_name=served_model_name(config.model, model_path),
                          block_size=config.block_size, num_kv_blocks=num_blocks, max_model_len=max_len,
                          vocab_size=cfg.vocab_size, eos_token_ids=eos_ids, generation_defaults=defaults,
                          rank=config.rank, world_size=config.world_size,
                          pipeline_parallel_size=config.pipeline_parallel_size,
                          dtype=str(dtype).removeprefix("torch."), kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
                          expert_parallel=config.enable_expert_parallel,
                          runner="generate" if pooling is None else "pooling", pooling=pooling,
                          lora_shapes=lora.store.shapes if lora is not None else None,
                          accepts_images=cfg.is_multimodal, images_whole=getattr(model, "images_whole", False),
                          encoder_layers=getattr(model, "encoder_layers", 0) if cfg.is_multimodal else 0,
                          **kv_tier_mover.hello_fields(tiers), kv_role=config.kv_role)
        sender = receiver = heads = None
        if config.kv_role:           # transfers carry every KV head; a -tp group's ranks gather or share them
            heads = KvHeads(cfg.num_key_value_heads, config.tensor_parallel_size)
            local_bytes = sum(c[:, 0].numel() * c.element_size() for c in caches)
            info = replace(info, kv_transfer_block_bytes=local_bytes // heads.per_rank * heads.total)
        if config.kv_role in ("prefill", "both"):
            sender = kv_transfer.KvSender(caches, config.kv_transfer_timeout, rank.comm, heads)
        if config.kv_role in ("decode", "both") and rank.comm.rank == 0:   # rank 0 receives for its group
            receiver = kv_transfer.KvReceiver(config.kv_transfer_host, config.kv_transfer_port,
                                              info.kv_transfer_block_bytes,
                                              lease=max(60.0, 2 * config.kv_transfer_timeout),
                                              max_blocks=tiers.num_host_blocks, dtype=kv_dtype)
            info = replace(info, kv_transfer_address=receiver.address)
        if pooling is not None:
            log.info("runner pooling: %s pooling, %snormalized, %d dims", pooling.pooling_type,
                     "" if pooling.normalize else "not ", pooling.hidden_size)
        tuning = _tune_and_warm_up(model, caches, config.block_size, max_len, dtype, config.tune_kernels) \
            if plan.attention_backend == "triton" and device.type == "cuda" else None
        graphs = None
        # graphs are for sampling steps (a pooling runner has none) over [T] positions (M-RoPE's are [3, T])
        if plan.cuda_graphs and pooling is None and not cfg.is_multimodal:
            graphs = StepGraphRunner(model, caches, config.block_size, max_len,
                                     graph_plan(config, local, lora is not None), lora)
            graphs.capture_all()
        runner = cls(model, caches, config.block_size, max_len, info, config.seed,
                     StructuredOutput(model_path, cfg.vocab_size), graphs, Pooler(pooling) if pooling else None, lora)
        runner.tp_comm = rank.comm
        runner.pipe = rank.pipe
        runner.tiers = tiers
        runner.kv_sender, runner.kv_receiver, runner.kv_heads = sender, receiver, heads
        runner.kernel_tuning = tuning
        runner.threads = make_thread_governor(config, device, plan)
        runner.keep_in_flight = keeps_step_in_flight(device, rank.pipe, pooling, cfg.is_multimodal)
        runner.weights = WeightUpdater(runner, lambda path: load_model(path, backend, max_len, dtype, device, plan,
                                                                       rank.share, rank.comm, rank.stage, rank.pipe),
                                       cfg, model_path)
        from steploop.gpu_worker.weight_receiver import WeightReceiver
        runner.receiver = WeightReceiver(runner, config.tp_host)
        runner.sleep_mode = SleepMode(runner, lambda: kv_cache.allocate_kv_caches(
            local, num_blocks, config.block_size, kv_dtype, device, plan.hugepages))
        return runner

    def reset(self) -> None:
        """Forget every request (the scheduler preempted them all, e.g. after a reconnect)."""
        self.batch.reset()
        self.in_flight = None                # its result goes nowhere: the scheduler preempted its requests
        if self.encoder is not None:
            self.encoder.reset()
        if self.weights is not None:
            self.weights.drop()
        if self.sleep_mode is not None:
            self.sleep_mode.wake()       # the next scheduler gets a worker that can serve what its hello says
        if self.lora is not None:
            self.lora.reset()

    def execute(self, plan: StepPlan) -> StepResult:
        """One step from plan to result, nothing kept in flight (the server keeps one: submit / drain)."""
        if self.in_flight is not None:
            raise RuntimeError("execute() with a step in flight: use submit() and drain()")
        return (self.submit(plan) + self.drain())[-1]

    def submit(self, plan: StepPlan) -> list[StepResult]:
        """Launch `plan`; return the results finished meanwhile, in plan order: the step that was in flight (if
        any), then this one unless it stays in flight (keep_in_flight, on a GPU: step_overlap.py)."""
        out = []
        pending, self.in_flight = self.in_flight, None
        if pending is not None and not may_follow(pending, plan):
            out.append(self._finish(pending))
            pending = None
        self._in_flight_tokens = pending.tokens if pending is not None else None   # what its holes point into
        try:
            launched = self._launch(plan)
        finally:
            self._in_flight_tokens = None
        if pending is not None:
            out.append(self._finish(pending))
        if launched.done or not self.keep_in_flight:
            out.append(self._finish(launched))
        else:
            self.in_flight = launched
        return out

    def drain(self) -> list[StepResult]:
        """The result of the step in flight ([] when none), once its sampled tokens are on the host."""
        pending, self.in_flight = self.in_flight, None
        return [self._finish(pending)] if pending is not None else []

    def _launch(self, plan: StepPlan) -> LaunchedStep:
        launched = LaunchedStep(plan, StepResult(step_id=plan.step_id))
        moved = pd = None
        try:
            moved = kv_tier_mover.apply(self.tiers, plan, self.tp_comm)   # before the forward: stores read, loads write
            pd = kv_transfer.apply(self, plan)                 # received blocks into host slots, after the moves
            if self.pipe is not None:
                self.batch.take_stage_tokens(plan, verify=self.samples_here)
            kv_block_copy.copy_blocks(self.kv_caches, plan.block_copies)   # beams' copy on write, then the forward
            self.batch.apply_plan(plan)
            self._apply_images(plan)
            if self.lora is not None:
                self.lora.apply_plan(plan)
            self.structured.check_new(plan.new_requests, self.batch.requests)   # a bad grammar fails its request
            if not plan.scheduled_handles:    # a plan that only moves blocks (a cross-replica pull's send)
                launched.result = StepResult(step_id=plan.step_id, kv_moves=moved,
                                             pd_report=kv_transfer.send_after(self, plan, pd))
                return launched
            with_lora = self.lora is not None and self.lora.begin_step(plan)
            if self.threads is not None:
                self.threads.before_step()
            try:
                self._run(plan, launched, with_lora)
            finally:
                if with_lora:
                    self.lora.end_step()
            if self.threads is not None:
                self.threads.after_step(time.perf_counter() - launched.start, plan.total_num_scheduled_tokens)
        except CollectiveError:      # the group broke: not this step's failure; the worker leaves the group
            raise
        except Exception as exc:     # a failed step is reported, the worker lives on
            log.exception("step %d failed", plan.step_id)
            launched.result = StepResult(step_id=plan.step_id, error=f"{type(exc).__name__}: {exc}", kv_moves=moved,
                                         pd_report=pd)
            launched.copy = None
            return launched
        result = launched.result
        launched.launch_seconds = result.forward_seconds = time.perf_counter() - launched.start
        result.kv_moves = moved
        result.pd_report = kv_transfer.send_after(self, plan, pd)   # the prompt's KV is written: send it
        result.failed = self.structured.take_failures()
        if self.tp_comm is not None:
            result.collective_seconds = self.tp_comm.take_seconds()[0]
        if self.pipe is not None:
            result.collective_seconds += self.pipe.take_seconds()[0]
        return launched

    def _finish(self, launched: LaunchedStep) -> StepResult:
        """Wait for the launched step's sampled tokens and record them (its placeholders become them)."""
        result = launched.result
        if launched.done:
            return result
        try:
            start = time.perf_counter()
            out = launched.copy.wait()
            waited = time.perf_counter() - start
            self._record(launched, out, result)
        except Exception as exc:
            log.exception("step %d failed", launched.plan.step_id)
            return StepResult(step_id=launched.plan.step_id, error=f"{type(exc).__name__}: {exc}",
                              kv_moves=result.kv_moves, pd_report=result.pd_report)
        result.forward_seconds = launched.forward_seconds(waited)
        return result

    def prepare_step(self, plan: StepPlan, backend=None) -> PreparedStep:
        """Everything before the forward, with ONE host-to-device copy and no sync: the step's inputs, the attention
        backend's host plan and the sampling rows are packed into the staging buffer, sent, then viewed on the
        device (penalties, logit edits and grammar masks, when a row asks for them, add their own copies)."""
        backend = backend or self.model.backend
        step = self.staging.begin()
        staged = stage_step_inputs(self.batch, plan, self.block_size, self.max_model_len, step)
        attn_staged = backend.stage_metadata(staged.query_lens, staged.seq_lens, step)
        rows = self._sampling_rows(staged.sampling) if staged.sampling and self.pooler is None \
            and self.samples_here else None
        sampling = StagedSampling.stage(rows.params, rows.index, self.vocab_size, step) if rows else None
        step.send()
        inputs = staged.finish(step, self.batch.table)
        inputs.fill_holes(self._in_flight_tokens)
        meta = sampling.finish(step, *self._penalties_and_edits(rows, inputs)) if sampling else None
        return PreparedStep(inputs, step, attn_staged, meta)

    @property
    def samples_here(self) -> bool:
        """False on a pipeline stage before the last: it takes the last stage's tokens instead."""
        return self.pipe is None or self.pipe.share.is_last

    def _run(self, plan: StepPlan, launched: LaunchedStep, with_lora: bool = False) -> None:
        """Forward and sample; the sampled tokens stay on the device (launched.tokens), their copy under way."""
        timing = _step_events(self.device) if self.keep_in_flight else None
        step = self.prepare_step(plan)
        inputs = step.inputs
        if self.pooler is not None:
            launched.result = self._run_pooling(plan, step)
            return
        prompt_rows = plan_prompt_logprob_rows(self.batch, plan)   # extra logits rows (prompt_logprobs.py)
        hidden = None
        attn_metadata = step.attn_metadata(self.model.backend)
        positions, mm_embeds = inputs.positions, None
        if self.encoder is not None:       # M-RoPE positions, this step's image embeddings and image spans
            positions, mm_embeds, spans = self.encoder.step_inputs(self.batch, plan, positions)
            if spans:
                attn_metadata.image_spans = spans
        elif self.graphs is not None:      # None back: this step runs eagerly (capture_plan.py: why)
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.attn, attn_metadata.plan,
                                     inputs.logits_indices, with_lora, bool(prompt_rows))
        if hidden is None:
            hidden = self.model(inputs.input_ids, positions, self.kv_caches, attn_metadata,
                                prompt_rows.logits_indices(inputs.logits_indices) if prompt_rows
                                else inputs.logits_indices, mm_embeds=mm_embeds)
        for handle, num_computed in inputs.num_computed_after.items():
            self.batch.requests[handle].num_computed_tokens = num_computed
        result = launched.result
        if not self.samples_here:
            self._skip_sampling(inputs)
            return
        if prompt_rows:
            num_sampling = len(inputs.logits_indices)
            result.prompt_logprobs = prompt_rows.compute(hidden[num_sampling:], self.model.compute_logits)
            hidden = hidden[:num_sampling]
        if inputs.sampling:
            out = self.sampler(self.model.compute_logits(hidden), step.sampling)
            if timing is not None:
                timing[1].record()
                launched.timing = timing
            launched.tokens, launched.copy = out.token_ids, out.start_copy()
            self._reserve(inputs, launched)

    def _apply_images(self, plan: StepPlan) -> None:
        if self.encoder is not None:
            self.encoder.apply_plan(plan)
        elif any(new.mm_features for new in plan.new_requests):
            raise ValueError(f"{self.info.model_name} is a text-only model: it cannot take image inputs")

    def _skip_sampling(self, inputs: StepInputs) -> None:
        """A stage before the last: the rows that sample there have their KV now; the token comes with the
        request's next plan (StepPlan.stage_token_ids), so this stage goes on to the next plan meanwhile."""
        for slot in inputs.sampling:
            if slot.drafts:
                raise ValueError("speculative drafts reached a pipeline stage: -pp serves without them")
            self.batch.requests[slot.handle].num_computed_tokens = slot.num_known_end

    def _run_pooling(self, plan: StepPlan, step: PreparedStep) -> StepResult:
        """Forward for the rows the pooler needs; the requests whose prompt is complete get their vector."""
        inputs = step.inputs
        rows = self.pooler.plan_rows(self.batch, plan)
        result = StepResult(step_id=plan.step_id)
        indices = torch.tensor(rows.rows, dtype=torch.int64, device=self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                            step.attn_metadata(self.model.backend), indices)
        for handle, num_computed in inputs.num_computed_after.items():
            self.batch.requests[handle].num_computed_tokens = num_computed
        for slot in inputs.sampling:     # its whole prompt is computed: nothing is sampled
            self.batch.requests[slot.handle].num_computed_tokens = slot.num_known_end
        result.pooled = self.pooler.pool(self.batch, rows, hidden)
        return result

    def _sampling_rows(self, sampling: list[SamplingSlot]) -> _SamplingRows:
        """Per logits row (a request's token, then one per draft): its params, output index, penalty inputs."""
        rows = _SamplingRows()
        for slot in sampling:
            state = self.batch.requests[slot.handle]
            penalized = state.sampling.penalized
            for j in range(len(slot.drafts) + 1):
                rows.params.append(state.sampling)
                rows.index.append(state.num_output_tokens + j)
                rows.prompts.append(state.token_ids[:state.num_prompt_tokens] if penalized else [])
                rows.outputs.append(state.output_token_ids + slot.drafts[:j] if penalized else [])
                rows.grammar.append((state, slot.drafts[:j]))
                rows.histories.append(_output_tail(state, slot.drafts[:j]) if state.sampling.bad_words else ())
        return rows

    def _penalties_and_edits(self, rows: _SamplingRows, inputs: StepInputs):
        """Penalty inputs and logit edits (None, None in the common case: no row uses them)."""
        penalties = PenaltyInputs.build(rows.params, rows.prompts, rows.outputs, self.vocab_size, self.device)
        self.structured.drop_missing(self.batch.requests)
        grammar = self.structured.bitmask(rows.grammar)
        edits = LogitsEdits.build(rows.params, rows.index, self.info.eos_token_ids, self.device, grammar,
                                  rows.histories)
        return penalties, edits

    def _sampling_metadata(self, inputs: StepInputs) -> SamplingMetadata:
        """The step's sampling metadata with its own copies (the runner's steps stage it: prepare_step)."""
        rows = self._sampling_rows(inputs.sampling)
        return SamplingMetadata.from_rows(rows.params, rows.index, self.vocab_size, self.device,
                                          *self._penalties_and_edits(rows, inputs))

    def _reserve(self, inputs: StepInputs, launched: LaunchedStep) -> None:
        """Each row that sampled without drafts holds its token's place (step_overlap.placeholder) until finish."""
        for slot in inputs.sampling:
            state = self.batch.requests[slot.handle]
            launched.sampling.append(slot)
            launched.states.append(state)
            if not slot.drafts:
                state.token_ids.append(placeholder(slot.first_row))
                state.num_computed_tokens = slot.num_known_end

    def _record(self, launched: LaunchedStep, out: HostSamplerOutput, result: StepResult) -> None:
        """Accept drafts while they match what was sampled; the tokens take their placeholders' places (or are
        appended, after drafts). States are the ones at launch: a request a later plan dropped still gets them."""
        tokens = out.token_ids
        for slot, state in zip(launched.sampling, launched.states):
            rows = tokens[slot.first_row:slot.first_row + len(slot.drafts) + 1]
            accepted = 1
            while accepted <= len(slot.drafts) and rows[accepted - 1] == slot.drafts[accepted - 1]:
                accepted += 1
            if slot.drafts:
                state.append_sampled(rows[:accepted], slot.num_known_end + accepted - 1)
            else:
                state.token_ids[slot.num_known_end] = rows[0]
            if self.structured.failed(state):
                continue   # kept here (a plan in flight may feed it), never reported: it ends with its error
            result.sampled[slot.handle] = rows[:accepted]
            self.structured.accept(state, rows[:accepted])
            if state.sampling.logprobs >= 0:
                result.logprobs[slot.handle] = _logprobs(out, slot, accepted, state.sampling.logprobs)


def _step_events(device: torch.device):
    """(start, end) timing events for a step's device work, the start recorded now (CUDA only)."""
    if device.type != "cuda":
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    return start, end


def _output_tail(state, drafts: list[int]) -> list[int]:
    """The output tokens before a row's token (drafts included), as far back as the longest bad word reaches."""
    reach = max(len(w) for w in state.sampling.bad_words) - 1
    if reach == 0:
        return []
    tail = state.token_ids[max(state.num_prompt_tokens, state.num_tokens - reach):] + drafts
    return tail[-reach:]


def _logprobs(out: HostSamplerOutput, slot: SamplingSlot, accepted: int, k: int) -> list[TokenLogprob]:
    rows = range(slot.first_row, slot.first_row + accepted)
    return [TokenLogprob(out.logprobs[r], out.top_token_ids[r][:k] if k > 0 else [],
                         out.top_logprobs[r][:k] if k > 0 else []) for r in rows]


@dataclass
class _SamplingRows:
    params: list[SamplingParams] = field(default_factory=list)   # [S] one per logits row that samples
    index: list[int] = field(default_factory=list)               # [S] output index of the token it samples
    prompts: list[list[int]] = field(default_factory=list)       # [S] prompt ids (penalized rows only)
    outputs: list[list[int]] = field(default_factory=list)       # [S] output ids so far (penalized rows only)
    grammar: list = field(default_factory=list)                  # [S] (request state, drafts before the row)
    histories: list = field(default_factory=list)                # [S] output tail before the row (bad_words only)


@dataclass
class PreparedStep:
    """What prepare_step made: the inputs on the device, and what the backend and the sampler need from the copy."""
    inputs: StepInputs
    staging: StepStaging
    attn_staged: Any                     # what the attention backend's stage_metadata returned
    sampling: SamplingMetadata | None    # None: nothing samples this step (or the pooling runner)

    def attn_metadata(self, backend) -> Any:
        staged = (self.staging, self.attn_staged) if self.attn_staged is not None else None
        return backend.build_metadata(self.inputs.attn, staged=staged)


def _tune_and_warm_up(model: LlamaForCausalLM, caches: list[torch.Tensor], block_size: int, max_len: int,
                      dtype: torch.dtype, tune: bool = True) -> dict:
    """Before the worker reports ready: pick the attention kernel's launch configs (kernels/tuning.py), then compile
    every variant serving can launch, so no Triton compile lands inside a step (graph capture warms the rest)."""
    from steploop.gpu_worker.kernels.tuning import tune_attention, warm_up_attention

    start = time.perf_counter()
    report = tune_attention(model.backend, caches[0], block_size, max_len, q_dtype=dtype) if tune \
        else {"classes": "defaults"}
    report["warmed"] = warm_up_attention(model.backend, caches[0], block_size, dtype)
    log.info("attention warm-up: %d variants compiled in %.1f s", len(report["warmed"]), time.perf_counter() - start)
    return report


def _num_params(model: LlamaForCausalLM) -> int:
    """Parameters as loaded: a packed linear's weight counts as its [out, in], a tied lm_head once."""
    tied = model.config.tie_word_embeddings
    packed = sum(m.packed.out_features * m.packed.in_features for name, m in model.named_modules()
                 if getattr(m, "packed", None) is not None and not (tied and name == "lm_head"))
    experts = sum(w.out_features * w.in_features for m in model.modules()              # GGUF MoE experts
                  for ws in getattr(m, "packed_experts", {}).values() for w in (ws if isinstance(ws, list) else [ws])
                  if not isinstance(w, torch.nn.Module))     # QuantLinear experts are modules: counted below
    held = sum(m.out_features * m.in_features for name, m in model.named_modules()     # QuantLinear, GgufLinear
               if hasattr(m, "in_features") and getattr(m, "weight", None) is None
               and getattr(m, "packed", None) is None and not (tied and name == "lm_head"))
    return sum(p.numel() for p in model.parameters()) + packed + experts + held


def _max_model_len(config: WorkerConfig, cfg: LlamaModelConfig) -> int:
    if config.max_model_len is None:
        return cfg.max_position_embeddings
    if config.max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"--max-model-len {config.max_model_len} exceeds the model's max_position_embeddings "
                         f"{cfg.max_position_embeddings}; lower it")
    return config.max_model_len


def _profile_forward(model: LlamaForCausalLM, cfg: LlamaModelConfig, block_size: int, max_len: int,
                     dtype: torch.dtype, device: torch.device, budget: int | None = None) -> torch.Tensor:
    """One forward over the whole token budget (default: one max-length prompt) of token 0, as prompts of at most
    max_len tokens, with a scratch KV cache, to measure peak activation memory; returns each prompt's last position's
    logits [num_prompts, vocab] (what real prompts of those lengths give)."""
    import numpy as np

    from steploop.gpu_worker.attention.metadata import build_common_metadata

    seqs = np.array(profile_sequences(budget or max_len, max_len), np.int32)
    blocks = -(-seqs.astype(np.int64) // block_size)                          # [R] blocks per prompt
    caches = kv_cache.allocate_kv_caches(cfg, int(blocks.sum()) + 1, block_size, dtype, device)
    table = np.zeros((len(seqs), int(blocks.max())), np.int32)
    first = np.cumsum(blocks) - blocks + 1                                     # block 0 stays the null block
    for r, (f, n) in enumerate(zip(first, blocks)):
        table[r, :n] = np.arange(f, f + n)
    pos = np.concatenate([np.arange(n) for n in seqs])
    req = np.repeat(np.arange(len(seqs)), seqs)
    slots = table[req, pos // block_size].astype(np.int64) * block_size + pos % block_size
    common = build_common_metadata(seqs, seqs, table, slots, block_size, device)
    ids = torch.zeros(len(pos), dtype=torch.int64, device=device)
    last = torch.from_numpy(np.cumsum(seqs).astype(np.int64) - 1).to(device)
    hidden = model(ids, torch.from_numpy(pos).to(device), caches, model.backend.build_metadata(common), last)
    if hidden is None:            # a pipeline stage before the last: no logits here
        return None
    logits = model.compute_logits(hidden)
    del caches
    return logits


def _profile_sampler(model: LlamaForCausalLM, rows: int, device: torch.device) -> torch.Tensor:
    """Logits and the sampler at full batch with every costly feature on (penalties, min-p, top-k/top-p sort,
    per-row noise, top-20 logprobs): the peak of a step's sampling (none on a pipeline stage before the last)."""
    if model.lm_head is None:
        return None
    hidden = torch.zeros(rows, model.config.hidden_size, dtype=next(model.parameters()).dtype, device=device)
    logits = model.compute_logits(hidden)
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                             logprobs=20)] * rows
    vocab = logits.shape[-1]
    penalties = PenaltyInputs.build(params, [[0]] * rows, [[0]] * rows, vocab, device)
    meta = SamplingMetadata.from_rows(params, [0] * rows, vocab, device, penalties)
    return Sampler(0, device)(logits, meta).token_ids


def _cuda_profile(model: LlamaForCausalLM, config: WorkerConfig, cfg: LlamaModelConfig, max_len: int,
                  dtype: torch.dtype, device: torch.device, plan) -> kv_cache.CudaProfile:
    """What the KV sizing measures (forward at the budget, sampler at --max-num-seqs) and reserves beside it."""
    budget = config.max_num_batched_tokens

    def reserves(forward_peak: int) -> dict[str, int]:
        elem = torch.empty((), dtype=dtype).element_size()
        graph_pool = 0
        if plan.cuda_graphs:
            from steploop.gpu_worker.kernels.paged_attention import choose_num_splits, num_sms
            graphs = graph_plan(config, cfg, config.lora.enable_lora)
            decode = max((k.tokens for k in graphs.capture_order() if k.kind == "decode"), default=0)
            splits = choose_num_splits(decode * cfg.num_key_value_heads, max_len, 1, num_sms(device))
            graph_pool = graph_pool_bytes(forward_peak, budget, max(k.tokens for k in graphs.capture_order()),
                                          len(graphs.capture_order()),
                                          split_partials_bytes(decode, cfg.num_attention_heads, cfg.head_dim, splits))
        lora = 0
        if config.lora.enable_lora:
            from steploop.gpu_worker.lora.manager import model_shapes
            lora = lora_slot_bytes(cfg.num_hidden_layers, model_shapes(cfg).targets, config.lora.max_loras,
                                   config.lora.max_lora_rank, elem)
        pipeline = nccl_bytes(config.world_size) if config.pipeline_parallel_size > 1 else 0   # the stages' group
        return {"graph_pool": graph_pool, "lora_slots": lora,
                "nccl": nccl_bytes(config.tensor_parallel_size) + pipeline}

    return kv_cache.CudaProfile(
        forward=lambda: _profile_forward(model, cfg, config.block_size, max_len, dtype, device, budget),
        sampler=lambda: _profile_sampler(model, config.max_num_seqs, device), reserves=reserves)


def _set_kv_scales(model: LlamaForCausalLM, backend, kv_dtype: torch.dtype, num_layers: int,
                   device: torch.device) -> None:
    """An FP8 cache's per-layer (k_scale, v_scale): the checkpoint's for e4m3 (else 1.0, as vLLM), 1.0 for e5m2."""
    stored = getattr(model, "kv_scales", None)
    if not kv_cache_dtype.is_fp8(kv_dtype):
        if stored is not None and stored.stored:
            log.info("the checkpoint carries FP8 KV cache scales; --kv-cache-dtype fp8 would use them")
        return
    if kv_cache_dtype.takes_scales(kv_dtype) and stored is not None:
        scales, source = stored.for_layers(num_layers)
    else:
        scales, source = {i: (1.0, 1.0) for i in range(num_layers)}, "1.0 (e5m2 runs unscaled)"
    backend.set_kv_scales(scales, device)
    log.info("KV cache %s (not exact: K and V rounded to 8 bits), scales %s", str(kv_dtype).removeprefix("torch."),
             source)


def _set_int8_activations(wanted: bool, model, plan) -> None:
    """--cpu-int8-activations: the packed Q4_1 / Q8_0 / Q4_K / Q6_K kernels round activations to int8
    (int8_activations.c), or the exact kernels (the default; also set back so, since the library is shared by every
    runner of a process). Refused where it would change nothing: no linear of those forms read at its width."""
    if plan.packed_linears:
        from steploop.gpu_worker.cpu_kernels.packed_linear import set_int8_activations
        set_int8_activations(False)
    if not wanted:
        return
    from steploop.gpu_worker.model.packed_linear_layer import int8_forms
    forms = int8_forms(model) if plan.packed_linears else {}
    if not forms:
        raise ValueError("--cpu-int8-activations applies to linears read at their width by the CPU kernels in the "
                         "Q4_1, Q8_0, Q4_K or Q6_K forms (GGUF files, the default model); this worker has " +
                         ("none" if plan.packed_linears else "no packed linears (" + plan.describe() + ")"))
    set_int8_activations(True)             # imported above: forms come only with packed linears
    log.warning("--cpu-int8-activations: %s linears multiply int8-rounded activations (llama.cpp's arithmetic); "
                "outputs are NOT equal to the fp32 reference",
                ", ".join(f"{n} {name}" for name, n in sorted(forms.items())))
