"""How much GPU memory the KV cache may take: everything else the worker will hold, measured or computed first.

    kv = total x --gpu-memory-utilization
         - in use now          weights (and anything else allocated), from cudaMemGetInfo
         - step peak           max(forward at the whole token budget, logits + sampler at --max-num-seqs rows):
                               measured by running them (budgets above 8192 too: the profile runs the budget,
                               cut into sequences of at most max_model_len)
         - CUDA-graph pool     graphs keep their activations in a private pool beside the eager steps' (estimated:
                               the forward's bytes per token x the largest graph's tokens, plus the decode graphs'
                               split-KV partials; the log compares it with what capture then took)
         - LoRA slots          the adapter slot tables, allocated after sizing (computed from the shapes)
         - NCCL buffers        tensor-parallel communicators, created after sizing (computed from NCCL_BUFFSIZE,
                               channels and ring neighbours; cudaMalloc'd outside torch's allocator)

Nothing here runs the model: kv_cache.py measures the peaks and passes them in, so the arithmetic is unit-tested.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GIB = 2 ** 30
NCCL_DEFAULT_BUFFSIZE = 4 << 20     # NCCL's default per-channel, per-peer buffer (SIMPLE protocol)
NCCL_DEFAULT_CHANNELS = 32          # NCCL's upper bound on channels for a ring on NVLink hosts
GRAPH_OVERHEAD = 2 << 20            # per captured graph: its own small allocations (workspaces, cuBLAS)


@dataclass(frozen=True)
class MemoryProfile:
    total: int                  # device memory, bytes
    utilization: float          # --gpu-memory-utilization
    in_use: int                 # allocated now (weights, the CUDA context, ...)
    forward_peak: int           # activations of one forward at the token budget, beyond what was in use
    sampler_peak: int           # logits and the sampler (sort, noise, logprobs) at --max-num-seqs rows
    graph_pool: int             # CUDA graphs' private pool (0 without graphs)
    lora_slots: int             # adapter slot tables (0 without --enable-lora)
    nccl: int                   # NCCL communicator buffers (0 at -tp 1)

    @property
    def step_peak(self) -> int:
        """The forward's activations are freed before sampling; the two peaks do not stack."""
        return max(self.forward_peak, self.sampler_peak)

    @property
    def kv_bytes(self) -> int:
        return int(self.total * self.utilization) - self.in_use - self.step_peak - self.graph_pool \
            - self.lora_slots - self.nccl

    def describe(self) -> str:
        parts = [("in use", self.in_use), ("forward peak", self.forward_peak), ("sampler peak", self.sampler_peak),
                 ("CUDA graphs", self.graph_pool), ("LoRA slots", self.lora_slots), ("NCCL", self.nccl)]
        return (f"GPU memory: total {self.total / GIB:.2f} GiB x utilization {self.utilization:.2f}; "
                + ", ".join(f"{name} {b / GIB:.2f} GiB" for name, b in parts)
                + f" -> KV cache {self.kv_bytes / GIB:.2f} GiB")


def graph_pool_bytes(forward_peak: int, profile_tokens: int, graph_tokens: int, num_graphs: int,
                     decode_split_bytes: int) -> int:
    """Graphs share one pool, captured largest first, so it holds about the largest graph's activations: the
    profiled forward's bytes per token x that graph's tokens; plus the split-KV partials of the largest decode graph
    (fp32 [T, H, splits, D + 2], allocated inside it) and a small fixed cost per graph."""
    if num_graphs == 0:
        return 0
    per_token = forward_peak / max(profile_tokens, 1)
    return int(per_token * graph_tokens) + decode_split_bytes + num_graphs * GRAPH_OVERHEAD


def split_partials_bytes(tokens: int, num_heads: int, head_dim: int, num_splits: int) -> int:
    """unified_attention's split buffers: acc [T, H, S, D] + max and sum [T, H, S], fp32."""
    return 0 if num_splits <= 1 else tokens * num_heads * num_splits * (head_dim + 2) * 4


def lora_slot_bytes(num_layers: int, targets: dict[str, tuple[int, int]], max_loras: int, max_rank: int,
                    elem_size: int) -> int:
    """adapter_store.AdapterStore: per target A [layers, L, r, in] and B [layers, L, out, r]; scale [L] fp32."""
    per_slot = sum(max_rank * (i + o) for i, o in targets.values())
    return num_layers * max_loras * per_slot * elem_size + 4 * max_loras


def nccl_bytes(world_size: int, env: dict[str, str] | None = None) -> int:
    """NCCL's buffers for one communicator: send and receive, per channel, per ring neighbour (2), NCCL_BUFFSIZE
    each (its LL/LL128 buffers are smaller and covered by the rounding up of channels)."""
    if world_size <= 1:
        return 0
    env = os.environ if env is None else env
    buffsize = int(env.get("NCCL_BUFFSIZE", NCCL_DEFAULT_BUFFSIZE))
    channels = int(env.get("NCCL_MAX_NCHANNELS", env.get("NCCL_MAX_CHANNELS", NCCL_DEFAULT_CHANNELS)))
    neighbours = min(world_size - 1, 2)
    return 2 * neighbours * channels * buffsize


def profile_sequences(budget: int, max_model_len: int) -> list[int]:
    """The profile forward's sequences: the whole token budget, each at most max_model_len long."""
    full, rest = divmod(budget, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])
