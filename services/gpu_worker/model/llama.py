"""Llama-family decoder over one flat batch of tokens and a paged KV cache.

forward(input_ids [T], positions [T], kv_caches, attn_metadata, logits_indices [S]) returns the final hidden
states only for the S rows that need logits; compute_logits runs lm_head on just those rows. The batch may mix
prompt chunks starting at any offset and single decode tokens: positions and the attention metadata say where
each token sits in its request.

The residual stream is carried beside the hidden states (vLLM's form): each norm adds the residual and
normalizes in one op (`ops.rms_norm(x, w, eps, residual)`), which the triton ops fuse into one kernel. Every
layer takes its elementwise ops (`plan.ops`) and its linear type (`plan.linear`) from the KernelPlan when it is
built (kernel_plan.py): torch, the fused Triton kernels, or the CPU's C kernels; nothing is swapped in later.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from services.gpu_worker.attention.backend import AttentionBackend
from services.gpu_worker.kernel_plan import KernelPlan
from services.gpu_worker.model.layers import LlamaMLP, RMSNorm
from services.gpu_worker.model.model_config import LlamaModelConfig
from services.gpu_worker.model.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaModelConfig, layer_idx: int, backend: AttentionBackend, plan: KernelPlan):
        super().__init__()
        self.layer_idx, self.backend = layer_idx, backend
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                            cfg.head_dim)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # [q_size + 2 * kv_size, hidden]: rows are q, then k, then v
        self.qkv_proj = plan.linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias)
        self.o_proj = plan.linear(self.q_size, cfg.hidden_size, cfg.attention_bias)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding, kv_cache: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        o = self.backend.forward(self.layer_idx, q, k, v, kv_cache, attn_metadata)   # [T, H, D]
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaModelConfig, layer_idx: int, backend: AttentionBackend, plan: KernelPlan):
        super().__init__()
        ops = plan.ops
        self.self_attn = LlamaAttention(cfg, layer_idx, backend, plan)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, ops, plan.linear)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                rotary: RotaryEmbedding, kv_cache: torch.Tensor,
                attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] this layer's input less the residual; residual [T, hidden] (None at layer 0)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, rotary, kv_cache, attn_metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaModelConfig, backend: AttentionBackend, plan: KernelPlan):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)   # weight [vocab, hidden]
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, backend, plan) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, plan.ops)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaModelConfig, backend: AttentionBackend, max_positions: int,
                 plan: KernelPlan | None = None):
        """plan None: KernelPlan.reference(backend.name), torch ops (Triton's with the triton backend), no C kernel."""
        super().__init__()
        plan = plan or KernelPlan.reference(backend.name)
        self.config, self.backend, self.plan = cfg, backend, plan
        self.model = LlamaModel(cfg, backend, plan)
        self.lm_head = plan.linear(cfg.hidden_size, cfg.vocab_size, False)   # weight [vocab, hidden]
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, plan.ops)
        self.cpu_decoder = None   # cpu_kernels/decoder.py's CpuDecoder, from bind_kv_caches when the plan has one

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> str:
        """Once the KV caches exist: the plan's C decoder (every layer in one call) points into them and the loaded
        weights. Returns how decode steps run, for the log."""
        if not self.plan.cpu_decoder:
            return "layer by layer (the kernel plan has no C decoder)"
        from services.gpu_worker.cpu_kernels.decoder import CpuDecoder
        self.cpu_decoder, how = CpuDecoder.build(self, kv_caches)
        return how

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: Any, logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids/positions [T]; kv_caches [num_layers] x [2, blocks, block_size, Hk, D];
        logits_indices [S] rows that need logits -> hidden [S, hidden]."""
        x, residual = self.model.embed_tokens(input_ids), None  # [T, hidden]
        if self.cpu_decoder is not None and getattr(attn_metadata, "whole_batch_in_kernel", False) \
                and self.cpu_decoder.serves(kv_caches):
            x, residual = self.cpu_decoder.forward(x, positions, attn_metadata.common)   # all layers in one C call
        else:
            for layer, kv_cache in zip(self.model.layers, kv_caches):
                x, residual = layer(positions, x, residual, self.rotary, kv_cache, attn_metadata)
        x, _ = self.model.norm(x[logits_indices], residual[logits_indices])   # [S, hidden]
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> logits [S, vocab] in fp32."""
        return self.lm_head(hidden).float()
