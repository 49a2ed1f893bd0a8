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

import torch

from steploop.common.model_path import served_model_name
from steploop.common.step_contract import StepPlan, StepResult, TokenLogprob, WorkerInfo
from steploop.gpu_worker import kv_cache, kv_tier_mover
from steploop.gpu_worker.attention.selector import create_backend
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.cpu_kernels.thread_governor import ThreadGovernor, make_thread_governor
from steploop.gpu_worker.cpu_kernels.threads import granted_cpus
from steploop.gpu_worker.cuda_graphs import DecodeGraphRunner
from steploop.gpu_worker.distributed.comm import CollectiveError
from steploop.gpu_worker.distributed.rank_setup import RankSetup
from steploop.gpu_worker.generation_config import generation_eos_ids, read_generation_defaults
from steploop.gpu_worker.input_batch import InputBatch
from steploop.gpu_worker.kernel_plan import resolve_kernel_plan
from steploop.gpu_worker.kv_tier_mover import KvTierMover, model_identity
from steploop.gpu_worker.logits_processors import LogitsEdits
from steploop.gpu_worker.lora.manager import LoraManager
from steploop.gpu_worker.model.llama import LlamaForCausalLM
from steploop.gpu_worker.model.loader import load_model
from steploop.gpu_worker.model.model_config import LlamaModelConfig
from steploop.gpu_worker.penalties import PenaltyInputs
from steploop.gpu_worker.pooling import Pooler, has_sentence_transformers_config, load_pooling_config
from steploop.gpu_worker.prompt_logprobs import plan_prompt_logprob_rows
from steploop.gpu_worker.sampler import Sampler, SamplerOutput, SamplingMetadata
from steploop.gpu_worker.sleep_mode import SleepMode
from steploop.gpu_worker.step_inputs import (
    SamplingSlot,
    StepInputs,
    prepare_step_inputs,
)
from steploop.gpu_worker.structured_output import StructuredOutput
from steploop.gpu_worker.weight_update import WeightUpdater

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], block_size: int,
                 max_model_len: int, info: WorkerInfo, seed: int = 0, structured: StructuredOutput | None = None,
                 graphs: DecodeGraphRunner | None = None, pooler: Pooler | None = None,
                 lora: LoraManager | None = None):
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.max_model_len, self.info = max_model_len, info
        self.device = kv_caches[0].device
        self.vocab_size = model.config.vocab_size
        self.batch = InputBatch()
        plan = getattr(model, "plan", None)
        self.sampler = Sampler(seed, self.device, plan.ops.argmax_rows if plan is not None else None)
        self.graphs = graphs             # decode-only steps replay CUDA graphs when set
        self.pooler = pooler             # --runner pooling: steps pool hidden states instead of sampling
        self.structured = structured or StructuredOutput(None, self.vocab_size)   # None: no tokenizer folder
        self.tp_comm = getattr(model, "tp_comm", None)   # a tensor-parallel rank's collectives, else None
        self.lora = lora                 # --enable-lora: adapters per request (lora/manager.py)
        self.threads: ThreadGovernor | None = None   # CPU: each step's thread count from measured step times
        self.weights: WeightUpdater | None = None   # /update_weights_from_disk (weight_update.py); from_config sets it
        self.sleep_mode: SleepMode | None = None     # /sleep, /wake_up (sleep_mode.py); from_config sets it
        self.receiver = None     # update_weights_from_distributed (weight_receiver.py); from_config sets it
        self.tiers: KvTierMover | None = None        # KV tiers below the pool (kv_tier_mover.py)

    @classmethod
    def from_config(cls, config: WorkerConfig, model_path: pathlib.Path) -> ModelRunner:
        """Resolve the kernel plan, build and load the model from it, size and allocate the KV cache, bind it."""
        device = torch.device(config.resolved_device())
        dtype = config.resolved_dtype(device.type)
        if device.type == "cpu":
            torch.set_num_threads(config.num_threads or granted_cpus())
        cfg = LlamaModelConfig.from_dir(model_path)
        rank = RankSetup.for_worker(config, cfg)    # refuses shapes that cannot split, before weights load
        pooling = (load_pooling_config(model_path, cfg.hidden_size) if config.runner == "pooling" or
                   (config.runner == "auto" and has_sentence_transformers_config(model_path)) else None)
        defaults = read_generation_defaults(config.generation_config, model_path)
        eos_ids = generation_eos_ids(config.generation_config, model_path, cfg.eos_token_ids)
        max_len = _max_model_len(config, cfg)
        plan = rank.kernel_plan(resolve_kernel_plan(config, device, dtype, rank.local_cfg))
        log.info("kernel plan: %s", plan.describe())
        local = rank.local_cfg
        backend = create_backend(plan.attention_backend, local.num_attention_heads, local.num_key_value_heads,
                                 local.head_dim, local.head_dim ** -0.5, plan.cpu_attention_kernel)
        start = time.perf_counter()
        log.info("loading model %s (%d layers, %s on %s)", model_path, cfg.num_hidden_layers,
                 str(dtype).removeprefix("torch."), device)
        model = load_model(model_path, backend, max_len, dtype, device, plan, rank.share, rank.comm)
        log.info("loaded %s in %.2f s: %.1f M params, %s on %s, max_model_len %d", model_path,
                 time.perf_counter() - start, _num_params(model) / 1e6,
                 str(dtype).removeprefix("torch."), device, max_len)
        profile = lambda: _profile_forward(model, local, config.block_size, max_len, dtype, device)
        rank.comm.local_only = True       # the memory profile runs before the group exists: shapes only
        num_blocks = kv_cache.decide_num_blocks(config, local, max_len, dtype, device, profile)
        rank.comm.local_only = False
        caches = kv_cache.allocate_kv_caches(local, num_blocks, config.block_size, dtype, device, plan.hugepages)
        log.info("decode steps: %s", model.bind_kv_caches(caches))
        if config.lora.enable_lora and pooling is not None:
            raise ValueError("--enable-lora serves generate models; this worker runs --runner pooling (embeddings)")
        lora = LoraManager.build(model, config.lora, dtype, device) if config.lora.enable_lora else None
        model.lora = lora.layers if lora is not None else None
        tiers = kv_tier_mover.build(config, caches, model_identity(model_path), dtype, plan.describe())
        info = WorkerInfo(worker_id=config.resolved_worker_id, model_name=served_model_name(config.model, model_path),
                          block_size=config.block_size, num_kv_blocks=num_blocks, max_model_len=max_len,
                          vocab_size=cfg.vocab_size, eos_token_ids=eos_ids, generation_defaults=defaults,
                          rank=config.rank, world_size=config.tensor_parallel_size,
                          dtype=str(dtype).removeprefix("torch."), expert_parallel=config.enable_expert_parallel,
                          runner="generate" if pooling is None else "pooling", pooling=pooling,
                          lora_shapes=lora.store.shapes if lora is not None else None,
                          **kv_tier_mover.hello_fields(tiers))
        if pooling is not None:
            log.info("runner pooling: %s pooling, %snormalized, %d dims", pooling.pooling_type,
                     "" if pooling.normalize else "not ", pooling.hidden_size)
        graphs = None
        if plan.cuda_graphs and pooling is None:    # graphs are for decode steps; a pooling runner has none
            graphs = DecodeGraphRunner(model, caches, config.block_size, max_len)
            graphs.capture_all()
        runner = cls(model, caches, config.block_size, max_len, info, config.seed,
                     StructuredOutput(model_path, cfg.vocab_size), graphs, Pooler(pooling) if pooling else None, lora)
        runner.tp_comm = rank.comm
        runner.tiers = tiers
        runner.threads = make_thread_governor(config, device, plan)
        runner.weights = WeightUpdater(runner, lambda path: load_model(path, backend, max_len, dtype, device, plan,
                                                                       rank.share, rank.comm), cfg, model_path)
        from steploop.gpu_worker.weight_receiver import WeightReceiver
        runner.receiver = WeightReceiver(runner, config.tp_host)
        runner.sleep_mode = SleepMode(runner, lambda: kv_cache.allocate_kv_caches(
            local, num_blocks, config.block_size, dtype, device, plan.hugepages))
        return runner

    def reset(self) -> None:
        """Forget every request (the scheduler preempted them all, e.g. after a reconnect)."""
        self.batch.reset()
        if self.weights is not None:
            self.weights.drop()
        if self.sleep_mode is not None:
            self.sleep_mode.wake()       # the next scheduler gets a worker that can serve what its hello says
        if self.lora is not None:
            self.lora.reset()

    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        moved = None
        try:
            moved = kv_tier_mover.apply(self.tiers, plan)      # before the forward: stores read, loads write
            self.batch.apply_plan(plan)
            if self.lora is not None:
                self.lora.apply_plan(plan)
            self.structured.check_new(plan.new_requests, self.batch.requests)   # a bad grammar fails its request
            if not plan.scheduled_handles:
                return StepResult(step_id=plan.step_id, kv_moves=moved)
            with_lora = self.lora is not None and self.lora.begin_step(plan)
            if self.threads is not None:
                self.threads.before_step()
            try:
                result = self._run(plan, with_lora)
            finally:
                if with_lora:
                    self.lora.end_step()
            if self.threads is not None:
                self.threads.after_step(time.perf_counter() - start, plan.total_num_scheduled_tokens)
        except CollectiveError:      # the group broke: not this step's failure; the worker leaves the group
            raise
        except Exception as exc:     # a failed step is reported, the worker lives on
            log.exception("step %d failed", plan.step_id)
            return StepResult(step_id=plan.step_id, error=f"{type(exc).__name__}: {exc}", kv_moves=moved)
        result.forward_seconds = time.perf_counter() - start
        result.kv_moves = moved
        result.failed = self.structured.take_failures()
        if self.tp_comm is not None:
            result.collective_seconds = self.tp_comm.take_seconds()[0]
        return result

    def _run(self, plan: StepPlan, with_lora: bool = False) -> StepResult:
        inputs = prepare_step_inputs(self.batch, plan, self.block_size, self.max_model_len, self.device)
        if self.pooler is not None:
            return self._run_pooling(plan, inputs)
        prompt_rows = plan_prompt_logprob_rows(self.batch, plan)   # extra logits rows (prompt_logprobs.py)
        hidden = None
        if self.graphs is not None and not prompt_rows and not with_lora:   # graphs hold the base path only
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.attn, len(inputs.logits_indices))
        if hidden is None:
            attn_metadata = self.model.backend.build_metadata(inputs.attn)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, attn_metadata,
                                prompt_rows.logits_indices(inputs.logits_indices) if prompt_rows
                                else inputs.logits_indices)
        for handle, num_computed in inputs.num_computed_after.items():
            self.batch.requests[handle].num_computed_tokens = num_computed
        result = StepResult(step_id=plan.step_id)
        if prompt_rows:
            num_sampling = len(inputs.logits_indices)
            result.prompt_logprobs = prompt_rows.compute(hidden[num_sampling:], self.model.compute_logits)
            hidden = hidden[:num_sampling]
        if inputs.sampling:
            out = self.sampler(self.model.compute_logits(hidden), self._sampling_metadata(inputs))
            self._record(inputs, out, result)
        return result

    def _run_pooling(self, plan: StepPlan, inputs: StepInputs) -> StepResult:
        """Forward for the rows the pooler needs; the requests whose prompt is complete get their vector."""
        rows = self.pooler.plan_rows(self.batch, plan)
        result = StepResult(step_id=plan.step_id)
        indices = torch.tensor(rows.rows, dtype=torch.int64, device=self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                            self.model.backend.build_metadata(inputs.attn), indices)
        for handle, num_computed in inputs.num_computed_after.items():
            self.batch.requests[handle].num_computed_tokens = num_computed
        for slot in inputs.sampling:     # its whole prompt is computed: nothing is sampled
            self.batch.requests[slot.handle].num_computed_tokens = slot.num_known_end
        result.pooled = self.pooler.pool(self.batch, rows, hidden)
        return result

    def _sampling_metadata(self, inputs: StepInputs) -> SamplingMetadata:
        params, index, prompts, outputs, histories = [], [], [], [], []
        for slot in inputs.sampling:
            state = self.batch.requests[slot.handle]
            for j in range(len(slot.drafts) + 1):
                params.append(state.sampling)
                index.append(state.num_output_tokens + j)
                histories.append(_output_tail(state, slot.drafts[:j]) if state.sampling.bad_words else ())
                if state.sampling.presence_penalty or state.sampling.frequency_penalty \
                        or state.sampling.repetition_penalty != 1.0:
                    prompts.append(state.token_ids[:state.num_prompt_tokens])
                    outputs.append(state.output_token_ids + slot.drafts[:j])
                else:
                    prompts.append([])
                    outputs.append([])
        penalties = PenaltyInputs.build(params, prompts, outputs, self.vocab_size, self.device)
        self.structured.drop_missing(self.batch.requests)
        grammar = self.structured.bitmask([(self.batch.requests[slot.handle], slot.drafts[:j])
                                           for slot in inputs.sampling for j in range(len(slot.drafts) + 1)])
        edits = LogitsEdits.build(params, index, self.info.eos_token_ids, self.device, grammar, histories)
        return SamplingMetadata.from_rows(params, index, self.vocab_size, self.device, penalties, edits)

    def _record(self, inputs: StepInputs, out: SamplerOutput, result: StepResult) -> None:
        """Accept drafts while they match what was sampled; append the accepted tokens to the worker's lists."""
        tokens = out.token_ids.tolist()
        for slot in inputs.sampling:
            rows = tokens[slot.first_row:slot.first_row + len(slot.drafts) + 1]
            accepted = 1
            while accepted <= len(slot.drafts) and rows[accepted - 1] == slot.drafts[accepted - 1]:
                accepted += 1
            self.batch.append_sampled(slot.handle, rows[:accepted], slot.num_known_end + accepted - 1)
            if self.structured.failed(self.batch.requests[slot.handle]):
                continue   # kept here (a plan in flight may feed it), never reported: it ends with its error
            result.sampled[slot.handle] = rows[:accepted]
            self.structured.accept(self.batch.requests[slot.handle], rows[:accepted])
            if self.batch.requests[slot.handle].sampling.logprobs >= 0:
                result.logprobs[slot.handle] = _logprobs(out, slot, accepted,
                                                         self.batch.requests[slot.handle].sampling.logprobs)


def _output_tail(state, drafts: list[int]) -> list[int]:
    """The output tokens before a row's token (drafts included), as far back as the longest bad word reaches."""
    reach = max(len(w) for w in state.sampling.bad_words) - 1
    if reach == 0:
        return []
    tail = state.token_ids[max(state.num_prompt_tokens, state.num_tokens - reach):] + drafts
    return tail[-reach:]


def _logprobs(out: SamplerOutput, slot: SamplingSlot, accepted: int, k: int) -> list[TokenLogprob]:
    rows = range(slot.first_row, slot.first_row + accepted)
    lps = []
    for r in rows:
        top_ids = out.top_token_ids[r, :k].tolist() if k > 0 else []
        top_lps = out.top_logprobs[r, :k].tolist() if k > 0 else []
        lps.append(TokenLogprob(float(out.logprobs[r]), top_ids, top_lps))
    return lps


def _num_params(model: LlamaForCausalLM) -> int:
    """Parameters as loaded: a packed linear's weight counts as its [out, in], a tied lm_head once."""
    tied = model.config.tie_word_embeddings
    packed = sum(m.packed.out_features * m.packed.in_features for name, m in model.named_modules()
                 if getattr(m, "packed", None) is not None and not (tied and name == "lm_head"))
    return sum(p.numel() for p in model.parameters()) + packed


def _max_model_len(config: WorkerConfig, cfg: LlamaModelConfig) -> int:
    if config.max_model_len is None:
        return cfg.max_position_embeddings
    if config.max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"--max-model-len {config.max_model_len} exceeds the model's max_position_embeddings "
                         f"{cfg.max_position_embeddings}; lower it")
    return config.max_model_len


def _profile_forward(model: LlamaForCausalLM, cfg: LlamaModelConfig, block_size: int, max_len: int,
                     dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One forward over a max-length prompt of token 0 (at most 8192) with a scratch KV cache, to measure peak
    activation memory; returns the last position's logits [1, vocab] (what a real prompt of that length gives)."""
    import numpy as np

    from steploop.gpu_worker.attention.metadata import build_common_metadata

    n = min(max_len, 8192)
    blocks = -(-n // block_size) + 1
    caches = kv_cache.allocate_kv_caches(cfg, blocks, block_size, dtype, device)
    table = np.arange(1, blocks, dtype=np.int32)[None, :]
    slots = np.arange(block_size, block_size + n, dtype=np.int64)
    common = build_common_metadata(np.array([n], np.int32), np.array([n], np.int32), table, slots, block_size,
                                   device)
    ids = torch.zeros(n, dtype=torch.int64, device=device)
    pos = torch.arange(n, device=device)
    hidden = model(ids, pos, caches, model.backend.build_metadata(common), torch.tensor([n - 1], device=device))
    logits = model.compute_logits(hidden)
    del caches
    return logits
