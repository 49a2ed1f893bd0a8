"""Gemma 3 with images (Gemma3ForConditionalGeneration): the Gemma 3 text decoder (llama.py, family gemma3_text)
plus transformers' own SigLIP tower and Gemma3MultiModalProjector (the oracle's modules, so the tower, the average
pooling to mm_tokens_per_image and the soft-embedding norm are exact by construction). An image is encoded once
(the worker's encoder cache, encoder_cache.py) into mm_tokens_per_image embeddings.

What differs from a text-only Gemma 3 in the decoder:
- embeddings: text tokens are scaled by sqrt(hidden) as always; image embeddings replace the placeholder rows
  after that scaling and are not scaled (transformers scales in the embedding module, then masked_scatter's).
- attention: an image's placeholder tokens attend to each other both ways (transformers ORs a same-image mask,
  built from token_type_ids, onto the causal and the sliding-window masks). Steps whose chunks hold image tokens
  attend every layer through model/windowed_attention.py with that mask (image_spans); the scheduler never ends a
  chunk inside an image (scheduler/encoder_budget.py whole_images), so the whole image is in the cache or in the
  step when any of it is computed.
The Triton kernel has no such mask: images are served on the CPU path only (refused on CUDA at start).
"""

from __future__ import annotations

import numpy as np
import torch

from steploop.common.mm_inputs import MultiModalFeature
from steploop.gpu_worker.model.llama import LlamaForCausalLM


class Gemma3VLForCausalLM(LlamaForCausalLM):
    images_whole = True          # the worker's hello tells the scheduler (WorkerInfo.images_whole)

    def __init__(self, cfg, backend, max_positions, plan=None):
        super().__init__(cfg, backend, max_positions, plan)
        from transformers import Gemma3Config
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector
        from transformers.models.siglip.modeling_siglip import SiglipVisionModel
        full = Gemma3Config(text_config={"hidden_size": cfg.hidden_size}, vision_config=cfg.vision_config,
                            mm_tokens_per_image=cfg.mm_tokens_per_image)
        vision = full.vision_config
        vision._attn_implementation = "sdpa"          # what transformers picks by default for the oracle too
        self.vision_tower = SiglipVisionModel._from_config(vision)
        self.multi_modal_projector = Gemma3MultiModalProjector(full)

    def finish_load(self, device: torch.device) -> None:
        """After the weights are in: SigLIP's position ids are a non-persistent buffer (not in the checkpoint,
        emptied by to_empty), so they are rebuilt as its __init__ does."""
        emb = self.vision_tower.vision_model.embeddings
        emb.position_ids = torch.arange(emb.num_positions, device=device).expand((1, -1))

    @torch.inference_mode()
    def encode_image(self, feature: MultiModalFeature) -> torch.Tensor:
        """One image's embeddings [mm_tokens_per_image, hidden] from its processed pixels [3, H, W]."""
        param = next(self.vision_tower.parameters())
        pixels = np.frombuffer(feature.pixel_values, dtype="<f4").reshape(feature.pixel_shape)
        pixels = torch.from_numpy(pixels.copy()).to(device=param.device, dtype=param.dtype)
        hidden = self.vision_tower(pixel_values=pixels.unsqueeze(0)).last_hidden_state
        out = self.multi_modal_projector(hidden)[0]
        if out.shape[0] != feature.length:
            raise ValueError(f"image {feature.hash[:12]}: the encoder gave {out.shape[0]} embeddings for "
                             f"{feature.length} placeholder tokens")
        return out
