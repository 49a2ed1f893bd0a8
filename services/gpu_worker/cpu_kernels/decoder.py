"""ctypes front end of decoder.c: every decoder layer in one C call, for CPU fp32 steps whose attention the C
kernel computes (decodes, short chunks, prompt chunks over short contexts).

    decoder, why = CpuDecoder.build(model, kv_caches)   # None (and why) unless every layer can run in C
                                                        # (LlamaForCausalLM.bind_kv_caches, when the KernelPlan asks)
    if decoder is not None and metadata.whole_batch_in_kernel:     # the torch backend's TorchAttentionMetadata
        x, residual = decoder.forward(x, positions, metadata.common)

The Model and Layer structs point at the packed weights, norm weights and KV caches, which live as long as the
model; each step passes its own Step struct (positions, slots, block tables). The result is bit for bit the
layer-by-layer Python path's (same kernels, same order, same buffers).
"""

from __future__ import annotations

import ctypes
import functools
from types import SimpleNamespace

import torch

from steploop.gpu_worker.cpu_kernels.build import function

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Matrix(ctypes.Structure):
    pass


_Matrix._fields_ = [("qs", _PTR), ("d", _PTR), ("m", _PTR), ("out_features", _I64), ("in_features", _I64),
                    ("kind", _I64), ("next", ctypes.POINTER(_Matrix))]     # next: a SPLIT weight's further parts


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _PTR), ("post_norm", _PTR), ("qkv", _Matrix), ("o", _Matrix), ("gate_up", _Matrix),
                ("down", _Matrix), ("kv_cache", _PTR)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _I64), ("hidden", _I64), ("num_heads", _I64), ("num_kv_heads", _I64),
                ("head_dim", _I64), ("intermediate", _I64), ("num_blocks", _I64), ("block_size", _I64),
                ("max_positions", _I64), ("eps", _F32), ("scale", _F32), ("layers", ctypes.POINTER(_Layer)),
                ("cos", _PTR), ("sin", _PTR)]


class _Step(ctypes.Structure):
    _fields_ = [("num_tokens", _I64), ("num_reqs", _I64), ("max_blocks", _I64), ("positions", _PTR),
                ("slot_mapping", _PTR), ("block_tables", _PTR), ("query_start_loc", _PTR), ("seq_lens", _PTR)]


@functools.cache
def _kernels() -> SimpleNamespace | None:
    fns = {"forward": function("steploop_decoder_forward", [ctypes.POINTER(_Model), ctypes.POINTER(_Step), _PTR,
                                                             _PTR, _PTR, ctypes.c_int]),
           "scratch": function("steploop_decoder_scratch", [ctypes.POINTER(_Model), _I64], _I64)}
    return None if None in fns.values() else SimpleNamespace(**fns)


def _matrix(packed, keep: list) -> _Matrix:
    """The struct of a packed weight (a SPLIT one: its first part, chained to the others, which `keep` holds)."""
    parts = packed.parts or [packed]
    rest = None
    for p in reversed(parts[1:]):
        rest = _Matrix(p.qs.data_ptr(), p.d.data_ptr(), p.m_or_d.data_ptr(), p.out_features, p.in_features, p.kind,
                       None if rest is None else ctypes.pointer(rest))
        keep.append(rest)
    p = parts[0]
    return _Matrix(p.qs.data_ptr(), p.d.data_ptr(), p.m_or_d.data_ptr(), p.out_features, p.in_features, p.kind,
                   None if rest is None else ctypes.pointer(rest))


def why_not(model, kv_caches: list[torch.Tensor]) -> str | None:
    """None when every layer can run in decoder.c, else the reason (for the log)."""
    from steploop.gpu_worker.model.cpu_ops import CpuOps
    if _kernels() is None:
        return "the CPU kernels did not build"
    if getattr(model.backend, "cpu_kernel", None) is None:
        return "the C attention kernel is off"
    if any(c.dtype != torch.float32 or c.device.type != "cpu" or not c.is_contiguous() for c in kv_caches):
        return "the KV cache is not contiguous fp32 on the CPU"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(getattr(lin, "packed", None) is not None and lin.bias is None for lin in linears):
            return "a linear layer is not packed (or has a bias)"
        if not (mlp.ops is CpuOps and layer.input_layernorm.ops is CpuOps and model.rotary.ops is CpuOps):
            return "the C elementwise ops are off"
    return None


class CpuDecoder:
    def __init__(self, model, kv_caches: list[torch.Tensor]):
        cfg, layers = model.config, model.model.layers
        self.kernels = _kernels()
        self._keep = [model.rotary.cos, model.rotary.sin, *kv_caches]       # the structs point into these
        self._cache_ptrs = [c.data_ptr() for c in kv_caches]
        self.layers = (_Layer * len(layers))(*[
            _Layer(layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                   *[_matrix(lin.packed, self._keep) for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                                 layer.mlp.gate_up_proj, layer.mlp.down_proj)],
                   cache.data_ptr())
            for layer, cache in zip(layers, kv_caches)])
        _, num_blocks, block_size, _, _ = kv_caches[0].shape
        attn = layers[0].self_attn
        self.model = _Model(len(layers), cfg.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                            layers[0].mlp.intermediate_size, num_blocks, block_size, model.rotary.cos.shape[0],
                            layers[0].input_layernorm.eps, model.backend.scale, self.layers,
                            model.rotary.cos.data_ptr(), model.rotary.sin.data_ptr())

    def serves(self, kv_caches: list[torch.Tensor]) -> bool:
        """Whether these are the caches the Layer structs point into (a profile run's scratch caches are not)."""
        return [c.data_ptr() for c in kv_caches] == self._cache_ptrs

    @classmethod
    def build(cls, model, kv_caches: list[torch.Tensor]) -> tuple[CpuDecoder | None, str]:
        """(decoder, why) -- the decoder is None when some layer cannot run in C; `why` says so for the log."""
        reason = why_not(model, kv_caches)
        return (None, reason) if reason else (cls(model, kv_caches), "all layers in one C call per step")

    def forward(self, x: torch.Tensor, positions: torch.Tensor, common) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] embeddings -> (last layer's MLP output, residual stream), both [T, hidden]."""
        t = x.shape[0]
        x = x.contiguous()
        residual = torch.empty_like(x)
        positions = positions.to(torch.int64).contiguous()
        slots = common.slot_mapping.to(torch.int64).contiguous()
        tables = common.block_tables.contiguous()
        query_start_loc, seq_lens = common.query_start_loc.contiguous(), common.seq_lens.contiguous()
        if positions.shape[0] != t or slots.shape[0] != t or x.dtype != torch.float32:
            raise ValueError(f"decoder: {t} tokens but {positions.shape[0]} positions, {slots.shape[0]} slots")
        step = _Step(t, common.num_reqs, tables.shape[1], positions.data_ptr(), slots.data_ptr(), tables.data_ptr(),
                     query_start_loc.data_ptr(), seq_lens.data_ptr())
        scratch = torch.empty(self.kernels.scratch(ctypes.byref(self.model), t), dtype=torch.float32)
        rc = self.kernels.forward(ctypes.byref(self.model), ctypes.byref(step), x.data_ptr(),
                                   residual.data_ptr(), scratch.data_ptr(), torch.get_num_threads())
        if rc:
            raise RuntimeError("decoder: bad step (a slot, position or block id out of range)")
        return x, residual
