"""Gemma 3 with images (Gemma3ForConditionalGeneration): the Gemma 3 text decoder (llama.py, family gemma3_text)
plus transformers' own SigLIP tower and Gemma3MultiModalProjector (the oracle's modules, so the tower, the average
pooling to mm_tokens_per_image and the soft-embedding norm are exact by construction). An image is encoded once
(the worker's encoder cache, encoder_cache.py) into mm_tokens_per_image embeddings, whole or a slice of SigLIP
layers per step (vision_slices.py).

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

import torch

from steploop.common.mm_inputs import MultiModalFeature
from steploop.gpu_worker.model.llama import LlamaForCausalLM
from steploop.gpu_worker.model.vision_slices import PartialEncode, check_length, pixels_of, run_layers


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
        """One image's embeddings [mm_tokens_per_image, hidden] from its processed pixels [3, H, W] (whole)."""
        pixels = pixels_of(feature, next(self.vision_tower.parameters())).unsqueeze(0)
        hidden = self.vision_tower(pixel_values=pixels).last_hidden_state
        return check_length(self.multi_modal_projector(hidden)[0], feature)

    # SigLIP a slice of encoder layers at a time (vision_slices.py): its forward split where its layer loop is.
    @property
    def encoder_layers(self) -> int:
        return len(self.vision_tower.vision_model.encoder.layers)

    @torch.inference_mode()
    def encoder_begin(self, feature: MultiModalFeature) -> PartialEncode:
        tower = self.vision_tower.vision_model
        pixels = pixels_of(feature, next(self.vision_tower.parameters())).unsqueeze(0)
        return PartialEncode(tower.embeddings(pixels), 0, {"feature": feature})

    @torch.inference_mode()
    def encoder_layers_run(self, state: PartialEncode, n: int) -> None:
        run_layers(self.vision_tower.vision_model.encoder.layers, state, n, lambda layer, i, h: layer(h, None))

    @torch.inference_mode()
    def encoder_end(self, state: PartialEncode) -> torch.Tensor:
        self.encoder_layers_run(state, self.encoder_layers)
        hidden = self.vision_tower.vision_model.post_layernorm(state.hidden)
        return check_length(self.multi_modal_projector(hidden)[0], state.extras["feature"])
