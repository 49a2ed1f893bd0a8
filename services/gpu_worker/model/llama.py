"""The Llama decoder over one flat batch of tokens and a paged KV cache, with each family's declared differences
(model_config.ModelConfig: biases, q/k norms, activation, norm placement, embedding / residual / logits scales,
soft-capping, per-layer sliding window and rope). One implementation; no per-family copies.

forward(input_ids [T], positions [T], kv_caches, attn_metadata, logits_indices [S]) returns the final hidden
states only for the S rows that need logits; compute_logits runs lm_head on just those rows. The batch may mix
prompt chunks starting at any offset and single decode tokens: positions and the attention metadata say where
each token sits in its request.

The residual stream is carried beside the hidden states (vLLM's form): the true hidden state is x + residual, and
each norm adds the residual and normalizes in one op (`ops.rms_norm(x, w, eps, residual)`), which the triton ops
fuse into one kernel. Every layer takes its elementwise ops (`plan.ops`) and its linear type (`plan.linear`) from
the KernelPlan when it is built (kernel_plan.py): torch, the fused Triton kernels, or the CPU's C kernels. Norm placements in that form:
    pre       x, r = in_norm(x, r); x = attn(x);           x, r = post_attn_norm(x, r); x = mlp(x)
    sandwich  x, r = in_norm(x, r); x = post_attn_norm(attn(x)); x, r = pre_ff_norm(x, r); x = post_ff_norm(mlp(x))
    post      h = x + r; x = post_attn_norm(attn(h)); h = x + h; x = post_ff_norm(mlp(h)); r = h
Layers with a sliding window or soft-capping attend through the backend when it serves them (the triton kernel
does), else through model/windowed_attention.py (torch); the others through the worker's attention backend.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from steploop.gpu_worker.attention.backend import AttentionBackend
from steploop.gpu_worker.kernel_plan import KernelPlan
from steploop.gpu_worker.model.layers import LlamaMLP, RMSNorm
from steploop.gpu_worker.model.model_config import ModelConfig
from steploop.gpu_worker.model.moe import SparseMoE
from steploop.gpu_worker.model.rotary import RotaryEmbedding
from steploop.gpu_worker.model.windowed_attention import WindowedAttention


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: AttentionBackend, max_positions: int,
                 plan: KernelPlan):
        super().__init__()
        self.layer_idx, self.backend = layer_idx, backend
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                            cfg.head_dim)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # [q_size + 2 * kv_size, hidden]: rows are q, then k, then v
        self.qkv_proj = plan.linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias)
        self.o_proj = plan.linear(self.q_size, cfg.hidden_size, cfg.output_bias)
        if cfg.qk_norm:
            q_dim, k_dim = (self.head_dim, self.head_dim) if cfg.qk_norm == "head" else (self.q_size, self.kv_size)
            self.q_norm, self.k_norm = RMSNorm(q_dim, cfg.rms_norm_eps), RMSNorm(k_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        window = cfg.window(layer_idx)
        window = window if window is not None and window < max_positions else None   # wider: the same as full
        self.windowed = None    # the torch path, for a backend without the kernel's window / soft-cap
        if (window is not None or cfg.attn_softcap is not None) and not backend.serve_variant(layer_idx, window,
                                                                                              cfg.attn_softcap):
            self.windowed = WindowedAttention(self.num_heads, self.num_kv_heads, self.head_dim, cfg.scale, window,
                                              cfg.attn_softcap)
        # Gemma 3 with images: steps holding image tokens attend in torch with the same-image mask (image_spans)
        self.image_attention = self.windowed
        if cfg.mm_tokens_per_image is not None and self.windowed is None:
            self.image_attention = WindowedAttention(self.num_heads, self.num_kv_heads, self.head_dim, cfg.scale,
                                                     window, cfg.attn_softcap)
        # the backend was built with the default scale; a family's own scale is folded into q for it
        self.q_rescale = cfg.scale / backend.scale if abs(cfg.scale - backend.scale) > 1e-12 else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding, kv_cache: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        if self.windowed is not None or (self.image_attention is not None and has_image_spans(attn_metadata)):
            o = self.image_attention.forward(q, k, v, kv_cache, attn_metadata)
        else:
            if self.q_rescale is not None:
                q = q * self.q_rescale
            o = self.backend.forward(self.layer_idx, q, k, v, kv_cache, attn_metadata)   # [T, H, D]
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: AttentionBackend, max_positions: int,
                 plan: KernelPlan):
        super().__init__()
        ops = plan.ops
        self.placement, self.residual_scale = cfg.norm_placement, cfg.residual_scale
        self.uses_local_rope = cfg.local_rope_theta is not None and cfg.window(layer_idx) is not None
        self.self_attn = LlamaAttention(cfg, layer_idx, backend, max_positions, plan)
        if cfg.moe is not None and layer_idx in cfg.moe.sparse_layers:
            self.mlp = SparseMoE(cfg.hidden_size, cfg.moe, cfg.hidden_act)
        else:
            self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, ops, plan.linear, cfg.hidden_act)
        if cfg.norm_placement != "post":
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        if cfg.norm_placement == "sandwich":
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        if cfg.norm_placement != "pre":
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                rotary: RotaryEmbedding, kv_cache: torch.Tensor,
                attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] this layer's input less the residual; residual [T, hidden] (None at layer 0)."""
        attend = lambda h: self._scaled(self.self_attn(positions, h, rotary, kv_cache, attn_metadata))
        if self.placement == "post":
            h = x if residual is None else x + residual
            x = self.post_attention_layernorm(attend(h))
            h = x + h
            return self.post_feedforward_layernorm(self._scaled(self.mlp(h))), h
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        if self.placement == "pre":
            x, residual = self.post_attention_layernorm(attend(x), residual)
            return self._scaled(self.mlp(x)), residual
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(attend(x)), residual)
        return self.post_feedforward_layernorm(self._scaled(self.mlp(x))), residual

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.residual_scale == 1.0 else x * self.residual_scale


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int, plan: KernelPlan):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)   # weight [vocab, hidden]
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, backend, max_positions, plan)
                                    for i in range(cfg.first_layer, cfg.first_layer + cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, plan.ops)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int,
                 plan: KernelPlan | None = None):
        """plan None: KernelPlan.reference(backend.name), torch ops (Triton's with the triton backend), no C kernel."""
        super().__init__()
        plan = plan or KernelPlan.reference(backend.name)
        self.config, self.backend, self.plan = cfg, backend, plan
        self.model = LlamaModel(cfg, backend, max_positions, plan)
        self.lm_head = plan.linear(cfg.hidden_size, cfg.vocab_size, False)   # weight [vocab, hidden]
        rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                                      plan.ops, rotary_dim=rotary_dim,
                                      max_position_embeddings=cfg.max_position_embeddings,
                                      original_max_position_embeddings=cfg.original_max_position_embeddings)
        self.local_rotary = None        # Gemma 3: the windowed layers' own base, default rope
        if cfg.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.local_rope_theta, None,
                                                plan.ops, rotary_dim=rotary_dim)
        self.cpu_decoder = None   # cpu_kernels/decoder.py's CpuDecoder, from bind_kv_caches when the plan has one
        self.lora = None          # lora/layers.py's LoraLayers with --enable-lora: a step with adapters runs in Python
        self.pipe = None          # a pipeline stage's PipelineComm (distributed/pipeline.py); None: every layer here

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> str:
        """Once the KV caches exist: the plan's C decoder (every layer in one call) points into them and the loaded
        weights. Returns how decode steps run, for the log."""
        if not self.plan.cpu_decoder:
            return "layer by layer (the kernel plan has no C decoder)"
        from steploop.gpu_worker.cpu_kernels.decoder import CpuDecoder
        self.cpu_decoder, how = CpuDecoder.build(self, kv_caches)
        return how

    def rotaries(self) -> list[RotaryEmbedding]:
        return [self.rotary] + ([self.local_rotary] if self.local_rotary is not None else [])

    def tie_weights(self) -> None:
        # a 16-bit table (model/half_weights.py) has no fp32 weight: its tied head shares its packed rows instead
        if self.config.tie_word_embeddings and self.lm_head is not None and \
                isinstance(self.model.embed_tokens, nn.Embedding):
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: Any, logits_indices: torch.Tensor,
                mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        """input_ids/positions [T] ([3, T] under M-RoPE); kv_caches [num_layers] x [2, blocks, block_size, Hk, D];
        logits_indices [S] rows that need logits; mm_embeds (rows [M], embeddings [M, hidden]): image embeddings
        that replace the placeholder tokens' at those rows -> hidden [S, hidden]; None on a pipeline stage before
        the last (it sent its hidden states on)."""
        pipe = self.pipe
        if pipe is None or pipe.share.is_first:
            x, residual = self.model.embed_tokens(input_ids), None  # [T, hidden]
            if self.config.embedding_scale != 1.0:    # in the model dtype, as transformers' Gemma normalizer
                x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)
            if mm_embeds is not None:                 # after the scale: Gemma 3 does not scale image embeddings
                x = x.index_copy(0, mm_embeds[0], mm_embeds[1].to(x.dtype))
        else:
            x, residual = pipe.recv_hidden(input_ids.shape[0], self.config.hidden_size,
                                           self.model.layers[0].post_attention_layernorm.weight.dtype,
                                           input_ids.device)
        if self.cpu_decoder is not None and getattr(attn_metadata, "whole_batch_in_kernel", False) \
                and self.cpu_decoder.serves(kv_caches) and not (self.lora is not None and self.lora.active) \
                and not has_image_spans(attn_metadata):
            x, residual = self.cpu_decoder.forward(x, positions, attn_metadata.common)   # all layers in one C call
        else:
            for layer, kv_cache in zip(self.model.layers, kv_caches):
                rotary = self.local_rotary if layer.uses_local_rope else self.rotary
                x, residual = layer(positions, x, residual, rotary, kv_cache, attn_metadata)
        if pipe is not None and not pipe.share.is_last:
            pipe.send_hidden(x, residual)
            return None
        x, _ = self.model.norm(x[logits_indices], residual[logits_indices])   # [S, hidden]
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> logits [S, vocab] in fp32."""
        logits = self.lm_head(hidden).float()
        if self.config.logits_scale != 1.0:
            logits = logits * self.config.logits_scale
        if self.config.final_softcap is not None:
            cap = self.config.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits


def has_image_spans(attn_metadata: Any) -> bool:
    """The step computes image tokens that attend to each other both ways (Gemma 3; model/windowed_attention.py)."""
    return bool(getattr(attn_metadata, "image_spans", None))
