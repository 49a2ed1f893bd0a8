"""The decoder's config: the fields the forward reads, parsed once from a HuggingFace folder (model/families.py).

Every supported family is the Llama decoder plus the declared differences below (defaults = Llama). A config.json
field that would change the output and is not one of these is refused at start (families.py), before weights load.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field
from typing import Any

from steploop.gpu_worker.model.moe import MoESpec
from steploop.gpu_worker.model.quant.config import QuantScheme

NORM_PLACEMENTS = ("pre", "sandwich", "post")   # pre: Llama; sandwich: Gemma 2/3 (pre and post); post: OLMo2


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False            # q/k/v projections' bias
    mlp_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    model_type: str = "llama"
    hidden_act: str = "silu"                # silu | gelu | gelu_tanh
    o_bias: bool | None = None              # None: same as attention_bias (Qwen2: q/k/v bias, no o bias)
    qk_norm: str = ""                       # "": none; "head": RMSNorm over head_dim (Qwen3, Gemma 3); "full": q_size
    norm_offset: float = 0.0                # Gemma: norms scale by (1 + w); folded into the weights at load
    norm_placement: str = "pre"
    embedding_scale: float = 1.0            # Gemma: sqrt(hidden); Granite: embedding_multiplier
    residual_scale: float = 1.0             # Granite: residual_multiplier on each block's output
    attention_scale: float | None = None    # None: head_dim ** -0.5 (Gemma 2/3: query_pre_attn_scalar; Granite)
    logits_scale: float = 1.0               # Granite: 1 / logits_scaling
    attn_softcap: float | None = None       # Gemma 2: tanh soft-capping of attention logits
    final_softcap: float | None = None      # Gemma 2: of the final logits
    layer_windows: tuple[int | None, ...] = ()   # per layer sliding window (keys i - W < j <= i); () or None: full
    local_rope_theta: float | None = None   # Gemma 3: windowed layers' rope base (default rope, no scaling)
    partial_rotary_factor: float = 1.0      # Phi: rotate this fraction of each head
    original_max_position_embeddings: int | None = None   # Phi-3 longrope
    moe: MoESpec | None = None              # Mixtral, Qwen3-MoE: the sparse layers' experts and routing
    quant: QuantScheme | None = None        # a quantized checkpoint's scheme (model/quant/config.py); None: dense
    # Vision-language (Qwen2.5-VL): M-RoPE's split of the rotary half-dims over (time, height, width) positions,
    # the vision tower's config (transformers' dict) and the placeholder token ids.
    mrope_section: tuple[int, ...] | None = None
    vision_config: dict[str, Any] | None = None
    image_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    mm_tokens_per_image: int | None = None  # Gemma 3: embeddings per image (its projector pools to them)
    first_layer: int = 0                    # a pipeline stage: its layers are [first_layer, + num_hidden_layers)

    @property
    def is_multimodal(self) -> bool:
        return self.vision_config is not None

    @classmethod
    def from_dir(cls, path: pathlib.Path) -> ModelConfig:
        from steploop.gpu_worker.model.families import parse_config
        return cls(**parse_config(path), eos_token_ids=_eos_ids(path))

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim ** -0.5

    @property
    def output_bias(self) -> bool:
        return self.attention_bias if self.o_bias is None else self.o_bias

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def is_plain_llama(self) -> bool:
        """The Llama decoder itself (what the C whole-step decoder implements): no declared difference."""
        return (self.hidden_act == "silu" and not self.qk_norm and not self.norm_offset
                and self.norm_placement == "pre" and self.embedding_scale == 1.0 and self.residual_scale == 1.0
                and self.attention_scale is None and self.logits_scale == 1.0 and self.attn_softcap is None
                and self.final_softcap is None and not any(w is not None for w in self.layer_windows)
                and self.partial_rotary_factor == 1.0 and not self.output_bias and self.moe is None
                and self.mrope_section is None)


LlamaModelConfig = ModelConfig   # the name the worker and older tests use


def _eos_ids(path: pathlib.Path) -> tuple[int, ...]:
    """EOS ids: generation_config.json wins over config.json (as in transformers)."""
    eos = json.loads((path / "config.json").read_text()).get("eos_token_id")
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
