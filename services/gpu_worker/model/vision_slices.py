"""A vision tower run a slice of layers at a time (the worker's encoder cache, encoder_cache.py; the scheduler
plans the slices: scheduler/encoder_budget.py), so one step never carries a whole image's encoder.

A model that can be sliced has `encoder_layers` (the tower's depth) and three methods, which together run exactly
the ops of its whole-image encode, in the same order on the same shapes (tests/vlm/test_encoder_slices.py holds
them to be bit-identical to the oracle's tower):

    encoder_begin(feature) -> PartialEncode      the patch / position embeddings; no layer run yet
    encoder_layers_run(state, n)                 the next n layers (fewer when fewer are left)
    encoder_end(state) -> [length, hidden]       any layers left, then the merger / projector
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from steploop.common.mm_inputs import MultiModalFeature


@dataclass
class PartialEncode:
    hidden: torch.Tensor                 # the tower's hidden state after `next_layer` layers
    next_layer: int = 0
    extras: dict = field(default_factory=dict)    # per family: what every layer reads (positions, masks, order)


def pixels_of(feature: MultiModalFeature, param: torch.Tensor) -> torch.Tensor:
    """The processed pixels on the tower's device and dtype."""
    pixels = np.frombuffer(feature.pixel_values, dtype="<f4").reshape(feature.pixel_shape)
    return torch.from_numpy(pixels.copy()).to(device=param.device, dtype=param.dtype)


def run_layers(layers, state: PartialEncode, n: int, call) -> None:
    """Advance state by up to n of `layers` (a ModuleList); call(layer, index, hidden) -> hidden."""
    stop = min(state.next_layer + n, len(layers))
    for i in range(state.next_layer, stop):
        out = call(layers[i], i, state.hidden)
        state.hidden = out[0] if isinstance(out, tuple) else out
    state.next_layer = stop


def check_length(out: torch.Tensor, feature: MultiModalFeature) -> torch.Tensor:
    if out.shape[0] != feature.length:
        raise ValueError(f"image {feature.hash[:12]}: the encoder gave {out.shape[0]} embeddings for "
                         f"{feature.length} placeholder tokens")
    return out


def encode_in_slices(model, feature: MultiModalFeature, layers_per_slice: int) -> torch.Tensor:
    """The whole image, `layers_per_slice` layers at a time (tests and the worker's on-demand finish)."""
    state = model.encoder_begin(feature)
    while state.next_layer < model.encoder_layers:
        model.encoder_layers_run(state, layers_per_slice)
    return model.encoder_end(state)
