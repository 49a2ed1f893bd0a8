"""WorkerConfig: the gpu_worker's one frozen config, from flags (each defaulting to STEPLOOP_<FLAG>).

Facts learned at run time (the resolved model folder, the number of KV blocks that fit) are not written back
here; they live in the runner's state and are reported to the scheduler in WorkerInfo.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, field

from steploop.common import lora_config
from steploop.common.envs import add_flag
from steploop.common.lora_config import LoraConfig
from steploop.common.pipeline_parallel_flag import add_pipeline_parallel_flag
from steploop.common.pipeline_parallel_flag import check_size as check_pp_size
from steploop.common.tensor_parallel_flag import add_tensor_parallel_flag, check_size
from steploop.common.tls import TlsConfig

ATTENTION_BACKENDS = ("auto", "triton", "torch")
RUNNERS = ("generate", "pooling", "auto")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")     # kv_cache_dtype.py


@dataclass(frozen=True)
class WorkerConfig:
    model: str | None = None                 # HF folder, or None / the default name for the default model
    scheduler_address: str = "127.0.0.1:50051"
    block_size: int = 16                     # tokens per KV block
    num_kv_blocks: int | None = None         # None: measure memory; N: exactly N blocks (block 0 included)
    kv_cache_memory_fraction: float = 0.1    # CPU: fraction of available RAM for the KV cache
    gpu_memory_utilization: float = 0.9      # CUDA: fraction of total GPU memory the worker may use
    max_model_len: int | None = None         # None: the model's max_position_embeddings
    dtype: str = "auto"                      # auto: float32 on CPU, bfloat16 on CUDA
    kv_cache_dtype: str = "auto"             # auto: the model's dtype; fp8 / fp8_e4m3 / fp8_e5m2 (kv_cache_dtype.py)
    calculate_kv_scales: bool = False        # vLLM's flag, refused: scales from the first batch are batch-dependent
    device: str = "auto"                     # auto: cuda if available, else cpu
    num_threads: int | None = None           # CPU threads; None: the CPUs the affinity mask and cgroup grant
    attention_backend: str = "auto"          # auto: triton on CUDA, torch on CPU (triton on CPU: TRITON_INTERPRET=1)
    cuda_graphs: bool = True                 # capture whole steps in CUDA graphs (CUDA + triton only)
    tune_kernels: bool = True                # CUDA + triton: time launch configs at start (cached per machine)
    cpu_int8_activations: bool = False       # Q4_1/Q8_0/Q4_K/Q6_K on the CPU: int8 activations (llama.cpp's; not exact)
    max_num_seqs: int = 128                  # the scheduler's: sizes decode graphs and the sampler's profile
    max_num_batched_tokens: int = 2048       # the scheduler's: sizes the memory profile's forward and mixed graphs
    worker_id: str = ""                      # "" -> host:pid
    seed: int = 0                            # seeds the shared generator used by unseeded sampled requests
    runner: str = "generate"                 # generate (text) | pooling (embeddings) | auto (pooling for a
                                             # sentence-transformers folder, i.e. one with modules.json)
    generation_config: str = "auto"          # auto | vllm | a folder: sampling defaults (generation_config.py)
    tls: TlsConfig = field(default_factory=TlsConfig)  # client cert + CA for the scheduler link (mutual TLS)
    tensor_parallel_size: int = 1            # ranks in this worker's group (1: no tensor parallelism)
    pipeline_parallel_size: int = 1          # pipeline stages (1: none); the group is tp x pp ranks
    rank: int = 0                            # this worker's rank in the group (stage rank // tp, tp rank rank % tp)
    tp_host: str = "127.0.0.1"               # address the other ranks reach this one at (process-group traffic)
    enable_expert_parallel: bool = False     # MoE: each rank holds E / N whole experts instead of 1/N of every one
    lora: LoraConfig = field(default_factory=LoraConfig)   # --enable-lora: the slot table and host LRU sizes
    kv_offloading_size: float = 0.0          # GiB of host memory for KV blocks below the pool (0: no host tier)
    kv_disk_path: str = ""                   # folder of the disk KV tier ("" : none); survives restarts
    kv_disk_size: float = 0.0                # GiB of block files the disk tier may hold
    kv_role: str = ""                        # "" (no transfers), "prefill", "decode" (P/D), or "both" (cross-replica
                                             # pulls: sends its blocks to other replicas and receives theirs)
    kv_transfer_host: str = "127.0.0.1"      # decode: the address prefill workers reach its block receiver at
    kv_transfer_port: int = 0                # decode: the receiver's port (0: any free one; said in the hello)
    kv_transfer_timeout: float = 30.0        # prefill: seconds a send may take until the receiver's answer

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkerConfig:
        return cls(model=args.model, scheduler_address=args.scheduler_address, block_size=args.block_size,
                   num_kv_blocks=args.num_kv_blocks, kv_cache_memory_fraction=args.kv_cache_memory_fraction,
                   gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
                   dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                   calculate_kv_scales=args.calculate_kv_scales, device=args.device, num_threads=args.num_threads,
                   attention_backend=args.attention_backend, cuda_graphs=args.cuda_graphs,
                   tune_kernels=args.tune_kernels, cpu_int8_activations=args.cpu_int8_activations,
                   max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   worker_id=args.worker_id, seed=args.seed, runner=args.runner,
                   generation_config=args.generation_config, tls=TlsConfig.from_args(args),
                   tensor_parallel_size=args.tensor_parallel_size,
                   pipeline_parallel_size=args.pipeline_parallel_size, rank=args.rank, tp_host=args.tp_host,
                   enable_expert_parallel=args.enable_expert_parallel, lora=LoraConfig.from_args(args),
                   kv_offloading_size=args.kv_offloading_size,
                   kv_disk_path=args.kv_disk_path, kv_disk_size=args.kv_disk_size, kv_role=args.kv_role,
                   kv_transfer_host=args.kv_transfer_host, kv_transfer_port=args.kv_transfer_port,
                   kv_transfer_timeout=args.kv_transfer_timeout)

    @property
    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{socket.gethostname()}:{os.getpid()}"

    def resolved_device(self) -> str:
        """auto: the CPU without CUDA; with it, one GPU per rank of a group on this host (rank R of -tp N on
        cuda:R, wrapping around when the host has fewer GPUs), as `--device cuda:N` picks one by hand. NCCL refuses
        two ranks of one group on the same GPU."""
        if self.device != "auto":
            return self.device
        import torch
        if not torch.cuda.is_available():
            return "cpu"
        return f"cuda:{self.rank % max(1, torch.cuda.device_count())}"

    def resolved_attention_backend(self, device: str) -> str:
        """auto -> triton on CUDA, torch on CPU. An explicit triton on the CPU needs TRITON_INTERPRET=1."""
        if self.attention_backend != "auto":
            if self.attention_backend == "triton" and device == "cpu" \
                    and os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
                raise ValueError("--attention-backend triton on the CPU needs TRITON_INTERPRET=1 (slow; tests "
                                 "only); use --attention-backend torch or auto")
            return self.attention_backend
        return "triton" if device.startswith("cuda") else "torch"

    def use_cuda_graphs(self, device: str) -> bool:
        """Graphs only on CUDA with the triton backend (the torch backend plans on the host every step)."""
        return self.cuda_graphs and device.startswith("cuda") and self.resolved_attention_backend(device) == "triton"

    def resolved_dtype(self, device: str):
        import torch
        name = self.dtype if self.dtype != "auto" else ("float32" if device == "cpu" else "bfloat16")
        return getattr(torch, name)


def _validate(c: WorkerConfig) -> None:
    def check(ok: bool, msg: str) -> None:
        if not ok:
            raise ValueError(msg)

    check(c.block_size > 0 and c.block_size & (c.block_size - 1) == 0,
          f"--block-size {c.block_size} must be a positive power of two (e.g. 16)")
    check(c.num_kv_blocks is None or c.num_kv_blocks >= 2,
          f"--num-kv-blocks {c.num_kv_blocks} must be at least 2 (block 0 is the null block)")
    check(0.0 < c.kv_cache_memory_fraction <= 0.95,
          f"--kv-cache-memory-fraction {c.kv_cache_memory_fraction} must be in (0, 0.95]")
    check(0.0 < c.gpu_memory_utilization <= 1.0,
          f"--gpu-memory-utilization {c.gpu_memory_utilization} must be in (0, 1]")
    check(c.max_model_len is None or c.max_model_len > 0, f"--max-model-len {c.max_model_len} must be positive")
    check(c.max_num_seqs >= 1, f"--max-num-seqs {c.max_num_seqs} must be >= 1")
    check(c.max_num_batched_tokens >= 1, f"--max-num-batched-tokens {c.max_num_batched_tokens} must be >= 1")
    check(c.dtype in DTYPES, f"--dtype {c.dtype!r} is not one of {', '.join(DTYPES)}")
    check(c.kv_cache_dtype in KV_CACHE_DTYPES,
          f"--kv-cache-dtype {c.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    check(not c.calculate_kv_scales,
          "--calculate-kv-scales: steploop does not compute FP8 K/V scales from the first batch it sees (every later "
          "output would depend on which requests came first); it uses the checkpoint's k_scale / v_scale, else 1.0. "
          "Drop the flag, or calibrate the scales into the checkpoint (llm-compressor's kv_cache_scheme)")
    check(c.device == "auto" or c.device == "cpu" or c.device.startswith("cuda"),
          f"--device {c.device!r} must be auto, cpu, cuda or cuda:N")
    check(c.num_threads is None or c.num_threads > 0, f"--num-threads {c.num_threads} must be positive")
    check(c.attention_backend in ATTENTION_BACKENDS,
          f"--attention-backend {c.attention_backend!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    check(c.runner in RUNNERS, f"--runner {c.runner!r} is not one of {', '.join(RUNNERS)}")
    check_size(c.tensor_parallel_size)
    check_pp_size(c.pipeline_parallel_size)
    check(0 <= c.rank < c.world_size,
          f"--rank {c.rank} must be in 0..{c.world_size - 1} for -tp {c.tensor_parallel_size} -pp "
          f"{c.pipeline_parallel_size}")
    _check_pipeline(c, check)
    # Neither path has been built for sharded weights: a rank's projections are split, an adapter's A/B and the
    # pooled hidden state are not; refused rather than served unchecked.
    check(c.tensor_parallel_size == 1 or not c.lora.enable_lora,
          f"--enable-lora with -tp {c.tensor_parallel_size}: LoRA adapters run on unsharded workers only (-tp 1)")
    check(c.tensor_parallel_size == 1 or c.runner == "generate",
          f"--runner {c.runner} with -tp {c.tensor_parallel_size}: the pooling runner serves with -tp 1 only")
    check(c.tensor_parallel_size > 1 or not c.enable_expert_parallel,
          "--enable-expert-parallel needs -tp 2 or more: the experts are placed across the group's ranks")
    check(c.kv_offloading_size >= 0, f"--kv-offloading-size {c.kv_offloading_size} must be >= 0 (GiB)")
    check(not c.kv_disk_path or (c.kv_disk_size > 0 and c.kv_offloading_size > 0),
          "--kv-disk-path needs --kv-disk-size > 0 and --kv-offloading-size > 0 (disk blocks come back through "
          "host memory)")
    check(not c.kv_disk_size or c.kv_disk_path, "--kv-disk-size needs --kv-disk-path")
    check(c.kv_role in ("", "prefill", "decode", "both"), f"--kv-role {c.kv_role!r} must be prefill, decode or both")
    check(c.kv_role not in ("decode", "both") or c.kv_offloading_size > 0,
          f"--kv-role {c.kv_role} needs --kv-offloading-size > 0: received blocks land in host slots, checked, before "
          "the pool loads them")
    check(c.kv_transfer_timeout > 0, f"--kv-transfer-timeout {c.kv_transfer_timeout} must be > 0 (seconds)")
    check(":" in c.scheduler_address, f"--scheduler-address {c.scheduler_address!r} must be host:port")


def _check_pipeline(c: WorkerConfig, check) -> None:
    """What pipeline stages have not been built for: refused, never served unchecked."""
    pp = c.pipeline_parallel_size
    if pp == 1:
        return
    check(not c.lora.enable_lora, f"--enable-lora with -pp {pp}: LoRA adapters run without pipeline stages only")
    check(c.runner == "generate", f"--runner {c.runner} with -pp {pp}: the pooling runner serves with -pp 1 only")
    check(not c.kv_offloading_size, f"--kv-offloading-size with -pp {pp}: KV tiers run without pipeline stages only")
    check(not c.kv_role, f"--kv-role {c.kv_role} with -pp {pp}: KV transfers gather a tensor-parallel group's heads, "
                         "not a pipeline's layers; run the prefill and decode groups with -pp 1")


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_flag(parser, "--model", default=None, help="a HuggingFace model folder of a supported family, or a .gguf file (default: SmolLM2-135M)")
    add_flag(parser, "--scheduler-address", default="127.0.0.1:50051", help="scheduler's plan-stream host:port")
    add_flag(parser, "--block-size", type=int, default=16, help="tokens per KV block")
    add_flag(parser, "--num-kv-blocks", type=int, default=None, help="KV blocks to allocate (skip measuring)")
    add_flag(parser, "--kv-cache-memory-fraction", type=float, default=0.1,
             help="CPU: fraction of available RAM given to the KV cache")
    add_flag(parser, "--gpu-memory-utilization", type=float, default=0.9,
             help="CUDA: fraction of GPU memory for weights, activations and KV cache")
    add_flag(parser, "--max-model-len", type=int, default=None,
             help="longest sequence (prompt + output); default and cap: the model's max_position_embeddings")
    add_flag(parser, "--dtype", default="auto", choices=DTYPES, help="weights and activations dtype")
    add_flag(parser, "--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
             help="KV cache storage: auto (the model's dtype, exact; bfloat16 where that is the model's) or fp8 / "
                  "fp8_e4m3 (the checkpoint's k/v scales, else 1.0) / fp8_e5m2: half a bf16 cache's bytes, not "
                  "exact; CUDA (triton backend) only")
    add_flag(parser, "--calculate-kv-scales", type=bool, default=False,
             help="vLLM's flag, refused with a message: FP8 K/V scales come from the checkpoint (else 1.0), never from "
                  "the first batch")
    add_flag(parser, "--device", default="auto", help="auto, cpu, cuda or cuda:N")
    add_flag(parser, "--num-threads", type=int, default=None,
             help="CPU threads (default: the CPUs the affinity mask and the cgroup's cpu.max quota grant)")
    add_flag(parser, "--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
             help="auto: triton on CUDA, torch on CPU; triton on the CPU needs TRITON_INTERPRET=1")
    add_flag(parser, "--cuda-graphs", type=bool, default=True,
             help="replay steps (decode, mixed, LoRA) from CUDA graphs (CUDA with the triton backend only)")
    add_flag(parser, "--tune-kernels", type=bool, default=True,
             help="CUDA with the triton backend: time the attention kernel's launch configs at start (cached per "
                  "machine); off: defaults. Either way every variant is compiled before the worker attaches")
    add_flag(parser, "--cpu-int8-activations", type=bool, default=False,
             help="Q4_1 / Q8_0 / Q4_K / Q6_K weights on the CPU (GGUF files, the default model): round activations "
                  "to int8 per 32 and multiply in integers, as "
                  "llama.cpp does (about 2x faster decode on an AVX2 CPU; VNNI dot products where the CPU has "
                  "AVX-512 VNNI and VBMI); NOT exact: outputs differ from the fp32 reference by that rounding. Off: "
                  "the exact kernels")
    add_flag(parser, "--max-num-seqs", type=int, default=128,
             help="the scheduler's --max-num-seqs: sizes the CUDA graphs and the sampler in the memory profile")
    add_flag(parser, "--max-num-batched-tokens", type=int, default=2048,
             help="the scheduler's token budget: sizes the memory profile's forward and the largest mixed graph")
    add_flag(parser, "--worker-id", default="", help="name in logs (default host:pid)")
    add_flag(parser, "--seed", type=int, default=0, help="seed for requests sampled without their own seed")
    add_flag(parser, "--runner", default="generate", choices=RUNNERS,
             help="generate: text (completions, chat, ...); pooling: embeddings (/v1/embeddings), pooled as the "
                  "folder's sentence-transformers config says (default: last token, normalized); auto: pooling "
                  "when the folder has a sentence-transformers modules.json")
    add_flag(parser, "--generation-config", default="auto",
             help="sampling defaults for requests that do not set them: auto (the model's generation_config.json), "
                  "vllm (none), or a folder holding a generation_config.json")
    TlsConfig.add_cli_args(parser)
    add_tensor_parallel_flag(parser)
    add_pipeline_parallel_flag(parser)
    add_flag(parser, "--rank", type=int, default=0, help="this worker's rank in its group, 0..tp x pp - 1 (stage rank // tp)")
    add_flag(parser, "--tp-host", default="127.0.0.1",
             help="address the group's other ranks reach this worker at (rank 0 also serves the group's store)")
    add_flag(parser, "--enable-expert-parallel", type=bool, default=False,
             help="mixture-of-experts models with -tp N: place E / N whole experts on each rank (contiguous) "
                  "instead of sharding every expert N ways; the attention stays sharded")
    lora_config.add_cli_args(parser)
    add_flag(parser, "--kv-offloading-size", type=float, default=0.0,
             help="GiB of host memory for KV blocks below the pool: prefix blocks the pool evicts and preempted "
                  "requests' blocks are kept there and restored (0: off; pinned memory on CUDA)")
    add_flag(parser, "--kv-disk-path", default="",
             help="folder for a disk KV tier below host memory (one checksummed file per block; survives "
                  "restarts; needs --kv-offloading-size and --kv-disk-size)")
    add_flag(parser, "--kv-disk-size", type=float, default=0.0, help="GiB of block files the disk KV tier may hold")
    add_flag(parser, "--kv-role", default="", choices=("", "prefill", "decode", "both"),
             help="prefill/decode disaggregation: join the scheduler's prefill group (computes prompts and sends "
                  "their KV blocks) or its decode group (receives them; needs --kv-offloading-size); both (as "
                  "vLLM's kv_both): a worker that serves everything and sends and receives KV blocks, so its "
                  "replica can pull a prefix cached on another one (needs --kv-offloading-size); default: a "
                  "worker that serves everything, no transfers")
    add_flag(parser, "--kv-transfer-host", default="127.0.0.1",
             help="--kv-role decode/both: the address prefill workers (or other replicas' workers) reach this "
                  "worker's KV block receiver at")
    add_flag(parser, "--kv-transfer-port", type=int, default=0,
             help="--kv-role decode/both: the KV block receiver's port (0: any free port, told to the scheduler)")
    add_flag(parser, "--kv-transfer-timeout", type=float, default=30.0,
             help="--kv-role prefill/both: seconds a KV transfer may take until the receiver answers (then the "
                  "request is recomputed on the decode group)")
    return parser
