"""Qwen2.5-VL: the Qwen2 decoder (llama.py) with M-RoPE, and transformers' own vision tower.

The vision tower is transformers' Qwen2_5_VisionTransformerPretrainedModel itself (the oracle's module, so its
windowed attention and patch merger are exact by construction); it runs once per image (the worker's encoder cache,
encoder_cache.py), whole or a slice of blocks per step (vision_slices.py). The decoder differs from Qwen2 only in its rotary: M-RoPE gives each token three positions
(time, height, width); the rotary half-dims are split by `mrope_section` and each part rotates by one of them.
Text tokens carry the same value in all three; an image's placeholder tokens carry its patch grid (mrope_positions).
"""

from __future__ import annotations

import numpy as np
import torch

from steploop.common.mm_inputs import MultiModalFeature
from steploop.gpu_worker.model.llama import LlamaForCausalLM
from steploop.gpu_worker.model.rotary import RotaryEmbedding
from steploop.gpu_worker.model.vision_slices import PartialEncode, check_length, pixels_of, run_layers


class MRotaryEmbedding(RotaryEmbedding):
    """Rotary over [3, T] positions (time, height, width); [T] positions are text (the same in all three)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, section: tuple[int, ...]):
        super().__init__(head_dim, max_positions, theta, None)
        self.section = list(section) * 2      # the cos/sin halves are each split the same way

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, T] or [T]; q [T, H, D]; k [T, Hk, D]."""
        if positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(3, -1)
        cos, sin = self._select(self.cos[positions]), self._select(self.sin[positions])   # [T, D] each
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def _select(self, table: torch.Tensor) -> torch.Tensor:
        """[3, T, D] -> [T, D]: part i of the rotary dims from position row i % 3 (transformers' layout)."""
        return torch.cat([part[i % 3] for i, part in enumerate(table.split(self.section, dim=-1))], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)            # [T, 1, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Qwen2_5_VLForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg, backend, max_positions, plan=None):
        super().__init__(cfg, backend, max_positions, plan)
        from transformers import Qwen2_5_VLConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
        self.rotary = MRotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.mrope_section)
        vision = Qwen2_5_VLConfig(vision_config=cfg.vision_config).vision_config
        vision._attn_implementation = "sdpa"          # what transformers picks by default for the oracle too
        self.visual = Qwen2_5_VisionTransformerPretrainedModel._from_config(vision)
        self.spatial_merge_size = vision.spatial_merge_size

    def finish_load(self, device: torch.device) -> None:
        """After the weights are in: the tower's rotary frequencies are a non-persistent buffer (not in the
        checkpoint, emptied by to_empty), so they are recomputed here as its __init__ does."""
        rotary = self.visual.rotary_pos_emb
        dim = rotary.inv_freq.shape[0] * 2
        rotary.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))

    @torch.inference_mode()
    def encode_image(self, feature: MultiModalFeature) -> torch.Tensor:
        """One image's embeddings [length, hidden] from its processed patches (the oracle's tower, whole)."""
        param = next(self.visual.parameters())
        grid = torch.tensor([feature.grid_thw], dtype=torch.int64, device=param.device)
        return check_length(self.visual(pixels_of(feature, param), grid_thw=grid), feature)

    # The tower a slice of layers at a time (vision_slices.py): its forward split where its layer loop is.
    @property
    def encoder_layers(self) -> int:
        return len(self.visual.blocks)

    @torch.inference_mode()
    def encoder_begin(self, feature: MultiModalFeature) -> PartialEncode:
        """The forward up to its first block: patch embedding, rotary and the window order (patches regrouped so
        each attention window is contiguous; the end undoes it)."""
        v = self.visual
        param = next(v.parameters())
        grid = torch.tensor([feature.grid_thw], dtype=torch.int64, device=param.device)
        hidden = v.patch_embed(pixels_of(feature, param))
        rotary = v.rot_pos_emb(grid)
        window_index, cu_window = v.get_window_index(grid)
        cu_window = torch.unique_consecutive(torch.tensor(cu_window, device=hidden.device, dtype=torch.int32))
        seq_len, unit = hidden.shape[0], v.spatial_merge_unit
        hidden = hidden.reshape(seq_len // unit, unit, -1)[window_index, :, :].reshape(seq_len, -1)
        rotary = rotary.reshape(seq_len // unit, unit, -1)[window_index, :, :].reshape(seq_len, -1)
        emb = torch.cat((rotary, rotary), dim=-1)
        cu_seqlens = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0]).cumsum(dim=0, dtype=torch.int32)
        cu_seqlens = torch.nn.functional.pad(cu_seqlens, (1, 0), value=0)
        return PartialEncode(hidden, 0, {"position_embeddings": (emb.cos(), emb.sin()), "cu_seqlens": cu_seqlens,
                                         "cu_window": cu_window, "window_index": window_index, "feature": feature})

    @torch.inference_mode()
    def encoder_layers_run(self, state: PartialEncode, n: int) -> None:
        full, x = self.visual.fullatt_block_indexes, state.extras
        run_layers(self.visual.blocks, state, n, lambda blk, i, h: blk(
            h, cu_seqlens=x["cu_seqlens"] if i in full else x["cu_window"],
            position_embeddings=x["position_embeddings"]))

    @torch.inference_mode()
    def encoder_end(self, state: PartialEncode) -> torch.Tensor:
        self.encoder_layers_run(state, self.encoder_layers)
        out = self.visual.merger(state.hidden)[torch.argsort(state.extras["window_index"]), :]
        return check_length(out, state.extras["feature"])


def mrope_positions(num_prompt: int, features: list[MultiModalFeature],
                    spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """([3, num_prompt] int64 positions of the prompt, delta): a token at index i >= num_prompt sits at i + delta
    in all three rows. transformers' Qwen2_5_VLModel.get_rope_index for images: text continues from the largest
    position so far + 1; an image's tokens sit at (0, row, column) of its merged grid, offset by where it starts."""
    out = np.empty((3, num_prompt), dtype=np.int64)
    next_pos, text_start = 0, 0
    for f in features:
        t, h, w = f.grid_thw
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        if t * gh * gw != f.length:
            raise ValueError(f"image {f.hash[:12]}: grid {f.grid_thw} merges to {t * gh * gw} tokens, its "
                             f"placeholder has {f.length}")
        n_text = f.offset - text_start
        out[:, text_start:f.offset] = next_pos + np.arange(n_text)
        base = next_pos + n_text
        out[0, f.offset:f.end] = base                     # images: time index 0 (second_per_grid_t is 0)
        out[1, f.offset:f.end] = base + np.repeat(np.tile(np.arange(gh), t), gw)
        out[2, f.offset:f.end] = base + np.tile(np.arange(gw), t * gh)
        next_pos = int(out[:, f.offset:f.end].max()) + 1
        text_start = f.end
    out[:, text_start:] = next_pos + np.arange(num_prompt - text_start)
    last = int(out[:, -1].max()) if num_prompt else -1
    return out, last + 1 - num_prompt
