"""How many KV blocks fit, and the cache tensors themselves.

One tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V). A block id names the
same block in every layer, so one block costs 2 * block_size * Hk * D * dtype_size * num_layers bytes.
Block 0 is kept by the scheduler as the null block; the worker simply allocates num_blocks blocks.

Sizing: on CUDA, after the weights are loaded, a profile forward at the token budget and the sampler at full batch
ran (memory_profile.py has the whole sum: CUDA-graph pool, LoRA slots and NCCL buffers come off too),
    kv_bytes = total * gpu_memory_utilization - in use - step peak - graph pool - LoRA slots - NCCL buffers
on CPU, kv_bytes = available RAM * kv_cache_memory_fraction. `--num-kv-blocks N` overrides both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from steploop.gpu_worker import host_memory
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.memory_profile import MemoryProfile
from steploop.gpu_worker.model.model_config import LlamaModelConfig

log = logging.getLogger(__name__)


def bytes_per_block(cfg: LlamaModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * elem * cfg.num_hidden_layers


def min_blocks(max_model_len: int, block_size: int) -> int:
    """Blocks for one full-length sequence, plus the null block."""
    return -(-max_model_len // block_size) + 1


def available_ram() -> int:
    """MemAvailable in bytes (psutil when installed, else /proc/meminfo)."""
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except ImportError:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("cannot read available memory; pass --num-kv-blocks")


def cpu_kv_bytes(fraction: float) -> int:
    available = available_ram()
    log.info("CPU memory available %.2f GiB; KV cache gets %.0f%% of it", available / 2**30, 100 * fraction)
    return int(available * fraction)


@dataclass(frozen=True)
class CudaProfile:
    """What the CUDA sizing runs and reserves (model_runner.py builds it)."""
    forward: Callable[[], object]                # one forward at the whole token budget
    sampler: Callable[[], object]                # logits + sampler at --max-num-seqs rows
    reserves: Callable[[int], dict[str, int]]    # forward peak -> graph_pool, lora_slots, nccl (memory_profile.py)


def cuda_kv_bytes(utilization: float, device: torch.device, profile: CudaProfile) -> int:
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    peaks = []
    for run in (profile.forward, profile.sampler):
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        peaks.append(torch.cuda.max_memory_allocated(device) - base)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    measured = MemoryProfile(total=total, utilization=utilization, in_use=total - free, forward_peak=peaks[0],
                             sampler_peak=peaks[1], **profile.reserves(peaks[0]))
    log.info("%s", measured.describe())
    return measured.kv_bytes


def decide_num_blocks(config: WorkerConfig, cfg: LlamaModelConfig, max_model_len: int, dtype: torch.dtype,
                      device: torch.device, profile: CudaProfile | None) -> int:
    per_block = bytes_per_block(cfg, config.block_size, dtype)
    if config.num_kv_blocks is not None:
        num_blocks, how = config.num_kv_blocks, "--num-kv-blocks"
    elif device.type == "cuda":
        num_blocks = cuda_kv_bytes(config.gpu_memory_utilization, device, profile) // per_block
        how = "--gpu-memory-utilization"
    else:
        num_blocks, how = cpu_kv_bytes(config.kv_cache_memory_fraction) // per_block, "--kv-cache-memory-fraction"
    need = min_blocks(max_model_len, config.block_size)
    log.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f KiB per block, %.2f GiB in all (%s)",
             num_blocks, config.block_size, num_blocks * config.block_size, per_block / 1024,
             num_blocks * per_block / 2**30, how)
    if num_blocks < need:
        raise ValueError(
            f"only {num_blocks} KV blocks fit ({how}), but one sequence of --max-model-len {max_model_len} needs "
            f"{need} (block size {config.block_size}, plus the null block); raise {how} or lower --max-model-len")
    return int(num_blocks)


def allocate_kv_caches(cfg: LlamaModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device, hugepages: bool = False) -> list[torch.Tensor]:
    """[num_layers] x [2, num_blocks, block_size, Hk, D], zeroed. hugepages: KernelPlan.hugepages (CPU only)."""
    shape = (2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    if device.type == "cpu":       # blocks are read scattered: huge pages spare a TLB miss per block
        return [host_memory.zeros(shape, dtype, hugepages) for _ in range(cfg.num_hidden_layers)]
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
