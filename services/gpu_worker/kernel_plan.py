"""KernelPlan: which implementation each part of the model runs, decided once at start.

    plan = resolve_kernel_plan(worker_config, device, dtype, model_config)   # WorkerConfig + STEPLOOP_CPU_* + facts
    model = load_model(path, create_backend(plan, ...), max_len, dtype, device, plan)   # layers pick ops at init
    model.bind_kv_caches(caches)                                             # the C decoder, when the plan has it

As vLLM's CustomOp picks its forward when a layer is built, the model's layers take their elementwise ops, their
linear layer type and the attention backend's kernel from the plan at construction; nothing is swapped in later
and nothing deep in the code reads the environment. The STEPLOOP_CPU_* switches are read here alone (their names
live in services/common/envs.py). A feature the plan leaves off carries its reason, logged once at start.

The C kernels (cpu_kernels/) serve fp32 on the CPU. Features on the CPU and what each needs:

    elementwise "cpu"     RMSNorm, rotary, SiLU-and-mul in C      torch attention backend, the library built
    packed_linears        linears read packed Q4_1/Q8_0 weights   the library built, faster than torch here (probe.py)
    cpu_attention_kernel  fused paged attention for short queries  torch backend, heads within the kernel's limits
    cpu_decoder           every layer in one C call per step      all three above (and every linear packed: at bind)
    hugepages             the CPU KV cache in 2 MiB pages         Linux with MADV_HUGEPAGE (any dtype)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from steploop.common import envs
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.model.model_config import LlamaModelConfig
from steploop.gpu_worker.model.ops import TorchOps, TritonOps

log = logging.getLogger(__name__)

ELEMENTWISE = ("torch", "triton", "cpu")


@dataclass(frozen=True)
class KernelPlan:
    attention_backend: str = "torch"     # "torch" (the oracle, the CPU path) or "triton"
    elementwise: str = "torch"           # "torch", "triton" (fused Triton kernels) or "cpu" (cpu_kernels/elementwise.c)
    packed_linears: bool = False         # linears take PackedLinear: exact Q4_1/Q8_0 weights run packed_linear.c
    cpu_attention_kernel: bool = False   # the torch backend's short queries run cpu_kernels/paged_attention.c
    cpu_decoder: bool = False            # steps whose attention is all the C kernel's run decoder.c (all layers)
    hugepages: bool = False              # the CPU KV cache asks for transparent huge pages (host_memory.py)
    cuda_graphs: bool = False            # steps replay CUDA graphs (capture_plan.py, cuda_graphs.py)
    why_off: tuple[tuple[str, str], ...] = ()   # (feature, reason) for each feature left off, for the log

    def __post_init__(self) -> None:
        if self.elementwise not in ELEMENTWISE:
            raise ValueError(f"elementwise ops {self.elementwise!r} are not one of {', '.join(ELEMENTWISE)}")
        if self.cpu_decoder and not (self.packed_linears and self.cpu_attention_kernel and self.elementwise == "cpu"):
            raise ValueError("the C decoder needs packed linears, the C attention kernel and the C elementwise ops")

    @classmethod
    def reference(cls, attention_backend: str = "torch") -> KernelPlan:
        """No C kernel: torch ops (the fused Triton ops with the triton backend). For tests and oracles."""
        return cls(attention_backend, "triton" if attention_backend == "triton" else "torch")

    @property
    def ops(self):
        """The elementwise ops class every norm, MLP and rotary layer calls (model/ops.py, model/cpu_ops.py)."""
        if self.elementwise == "cpu":
            from steploop.gpu_worker.model.cpu_ops import CpuOps
            return CpuOps
        return TritonOps if self.elementwise == "triton" else TorchOps

    def linear(self, in_features: int, out_features: int, bias: bool) -> nn.Linear:
        """The model's linear layer: PackedLinear (packs its weight after loading) or a plain nn.Linear."""
        if self.packed_linears:
            from steploop.gpu_worker.model.packed_linear_layer import PackedLinear
            return PackedLinear(in_features, out_features, bias=bias)
        return nn.Linear(in_features, out_features, bias=bias)

    def describe(self) -> str:
        """One line for the start-up log."""
        on = [f"attention {self.attention_backend}" + (" + C paged kernel" if self.cpu_attention_kernel else ""),
              f"elementwise {self.elementwise}", "packed linears" if self.packed_linears else "fp32 linears"]
        on += [name for name, flag in (("C decoder", self.cpu_decoder), ("huge pages", self.hugepages),
                                       ("CUDA graphs", self.cuda_graphs)) if flag]
        off = "; ".join(f"no {feature}: {why}" for feature, why in self.why_off)
        return ", ".join(on) + (f" ({off})" if off else "")


def resolve_kernel_plan(config: WorkerConfig, device: torch.device, dtype: torch.dtype,
                        cfg: LlamaModelConfig, stored_quantized: bool = False) -> KernelPlan:
    """The plan for this worker: its flags, the STEPLOOP_CPU_* switches, the device and the model's shapes.
    stored_quantized: the checkpoint's weights are read at their stored width (a quantization_config, a GGUF file,
    bf16 / fp16 tensors): no probe against an fp32 copy."""
    backend = config.resolved_attention_backend(device.type)
    if device.type != "cpu":
        # graphs need the triton backend, whose kernel also serves sliding-window / soft-capped layers
        return KernelPlan(backend, "triton" if backend == "triton" else "torch",
                          cuda_graphs=config.use_cuda_graphs(device.type))
    why: dict[str, str | None] = {"huge pages": _why_no_hugepages()}
    if dtype == torch.float32:
        why.update(_why_no_cpu_kernels(backend, cfg, stored_quantized))
    else:
        why.update(dict.fromkeys(("C elementwise ops", "packed linears", "C attention kernel", "C decoder"),
                                 f"the C kernels are fp32 only (--dtype {str(dtype).removeprefix('torch.')})"))
    elementwise = "cpu" if why["C elementwise ops"] is None else ("triton" if backend == "triton" else "torch")
    return KernelPlan(backend, elementwise, packed_linears=why["packed linears"] is None,
                      cpu_attention_kernel=why["C attention kernel"] is None, cpu_decoder=why["C decoder"] is None,
                      hugepages=why["huge pages"] is None,
                      why_off=tuple((feature, reason) for feature, reason in why.items() if reason))


def _why_no_hugepages() -> str | None:
    import mmap

    off = envs.switched_off(envs.CPU_HUGEPAGES)
    if off:
        return f"{off}=0"
    return None if hasattr(mmap, "MADV_HUGEPAGE") else "this OS has no MADV_HUGEPAGE"


def _why_no_cpu_kernels(backend: str, cfg: LlamaModelConfig, stored_quantized: bool) -> dict[str, str | None]:
    """Each C-kernel feature -> None (on) or why it is off, for fp32 on the CPU. A start-up probe times the packed
    matmul against torch's on the model's shapes and keeps the faster (the log names both figures). Not for stored
    quantized weights: they have no fp32 copy to weigh against (torch would first widen them, 4-8x the memory), so
    whether they run packed can never hang on a timing taken on a busy machine."""
    def switch(*names: str) -> str | None:
        off = envs.switched_off(envs.CPU_KERNELS, *names)
        return f"{off}=0" if off else None

    def built() -> str | None:          # builds the library (once per host) only when a switch leaves it on
        from steploop.gpu_worker.cpu_kernels.build import load
        return None if load() is not None else "the CPU kernels did not build (see the warning above)"

    def torch_backend() -> str | None:
        return None if backend == "torch" else f"the {backend} attention backend has its own kernels"

    def heads_fit() -> str | None:
        from steploop.gpu_worker.cpu_kernels.paged_attention import supports
        if supports(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim):
            return None
        return (f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads of size {cfg.head_dim}: "
                "past the kernel's limits")

    def faster_than_torch() -> str | None:    # times both on the model's shapes (cpu_kernels/probe.py)
        from steploop.gpu_worker.cpu_kernels.probe import layer_shapes, probe_packed_linear
        if stored_quantized:
            return None
        if envs.switched_off(envs.CPU_KERNEL_PROBE):
            log.info("packed-linear probe skipped (%s=0)", envs.CPU_KERNEL_PROBE)
            return None
        shapes = layer_shapes(cfg)
        if not shapes:
            return ("no linear of this model fits the packed layout (out_features % 16 and in_features % 32): "
                    "nothing to pack")
        result = probe_packed_linear(shapes)
        log.info("%s: %s", "packed linears" if result.use_packed else "torch matmuls", result.describe())
        return None if result.use_packed else f"torch is faster here: {result.describe()}"

    why = {"C elementwise ops": switch() or torch_backend() or built(),
           "packed linears": switch(envs.CPU_PACKED_WEIGHTS) or built() or faster_than_torch(),
           "C attention kernel": switch(envs.CPU_ATTENTION_KERNEL) or torch_backend() or heads_fit() or built()}
    needs = next((f"no {feature}" for feature, reason in why.items() if reason), None)
    why["C decoder"] = switch(envs.CPU_DECODER) or needs or (
        None if cfg.is_plain_llama else f"{cfg.model_type}: decoder.c is the plain Llama layer (this family is torch)")
    return why
