"""Pick and build the attention backend a KernelPlan names (the interface itself is backend.py)."""

from __future__ import annotations

from steploop.gpu_worker.attention.backend import AttentionBackend

BACKENDS = ("torch", "triton")


def create_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                   cpu_kernel: bool = False) -> AttentionBackend:
    """name is a resolved backend (KernelPlan.attention_backend); cpu_kernel: the torch backend runs short queries
    in cpu_kernels/paged_attention.c (KernelPlan.cpu_attention_kernel)."""
    if name == "torch":
        from steploop.gpu_worker.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scale, cpu_kernel)
    if cpu_kernel:
        raise ValueError(f"the C paged-attention kernel is part of the torch backend, not {name!r}")
    if name == "triton":
        from steploop.gpu_worker.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim, scale)
    raise ValueError(f"--attention-backend {name!r} is not available (choose: {', '.join(BACKENDS)})")
