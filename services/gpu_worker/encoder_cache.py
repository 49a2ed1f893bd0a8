"""The worker's multimodal state: each live request's images and M-RoPE positions (Qwen2.5-VL), and the encoder
cache.

The encoder cache maps an image hash to its embeddings [length, hidden]. An image is encoded the first time a
scheduled chunk reaches its placeholder range and stays until the scheduler frees the hash
(StepPlan.encoder_free_hashes), so a prompt whose placeholder range is cut by chunked prefill, or another request
with the same image, reuses it. The scheduler mirrors this cache (scheduler/encoder_budget.py) to budget encoder
work per step; if an entry is missing here anyway (e.g. after a worker restart), it is encoded again: the same
embeddings, so never a wrong token.

An image the scheduler splits (encoder slices, scheduler/encoder_budget.py) is encoded a slice of tower layers per
step: each StepPlan.encoder_slices entry runs the next layers of that image, its hidden state kept here (partial,
keyed by the hash like the entries) until a chunk reaches its placeholders, which runs what is left (the last
layers, the merger / projector: model/vision_slices.py). A freed hash drops its partial state as its entry.

step_inputs() turns a plan into the forward's extras: positions ([3, T] under M-RoPE, else the step's own [T]),
(rows, embeddings) of the placeholder tokens scheduled this step, and, for a model whose image tokens attend to each
other both ways (Gemma 3, model.images_whole), each batch row's image spans for the attention mask
(model/windowed_attention.py); a chunk that ends inside an image is an error there (the scheduler never plans one).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from steploop.common import tracing
from steploop.common.mm_inputs import MultiModalFeature
from steploop.common.step_contract import StepPlan
from steploop.gpu_worker.input_batch import InputBatch
from steploop.gpu_worker.model.qwen2_5_vl import mrope_positions
from steploop.gpu_worker.model.vision_slices import PartialEncode


@dataclass
class _RequestImages:
    features: list[MultiModalFeature]
    prompt_positions: np.ndarray | None   # [3, num_prompt] int64 under M-RoPE; None: positions are indices
    delta: int                            # a token at index i >= num_prompt sits at i + delta
    traceparent: str = ""                 # the request's trace (tracing on): its images' encode spans join it


class EncoderCache:
    def __init__(self, model, device: torch.device):
        self.model, self.device = model, device
        self.entries: dict[str, torch.Tensor] = {}     # image hash -> [length, hidden]
        self.partial: dict[str, PartialEncode] = {}    # image hash -> its tower's state after some layers
        self.requests: dict[int, _RequestImages] = {}
        self.num_encoded = 0                           # images the tower ran on (tests and metrics read it)
        self.mrope = model.config.mrope_section is not None
        self.images_whole = getattr(model, "images_whole", False)

    def apply_plan(self, plan: StepPlan) -> None:
        """Before InputBatch.apply_plan's effects are used: drop gone requests and freed entries, add new ones,
        run the plan's encoder slices."""
        # A slice may be for a request this plan preempts (the scheduler preempted it after planning the slice).
        gone = [self.requests.pop(h) for h in (*plan.finished_handles, *plan.preempted_handles)
                if h in self.requests] if plan.encoder_slices else ()
        for handle in (*plan.finished_handles, *plan.preempted_handles):
            self.requests.pop(handle, None)
        for h in plan.encoder_free_hashes:
            self.entries.pop(h, None)
            self.partial.pop(h, None)
        for new in plan.new_requests:
            positions, delta = None, 0
            if self.mrope:
                positions, delta = mrope_positions(len(new.prompt_token_ids), new.mm_features,
                                                   self.model.spatial_merge_size)
            self.requests[new.handle] = _RequestImages(list(new.mm_features), positions, delta, new.traceparent)
        if plan.encoder_slices:
            self._run_slices(plan.encoder_slices, [*self.requests.values(), *gone])

    def _run_slices(self, slices: list[tuple[str, int]], holders: list[_RequestImages]) -> None:
        by_hash = {f.hash: (f, r.traceparent) for r in holders for f in r.features}
        for image_hash, layers in slices:
            if image_hash in self.entries:
                continue                  # encoded whole after a worker restart; the scheduler counts slices
            feature, traceparent = by_hash[image_hash]
            with _encode_span(feature, traceparent, layers):
                state = self.partial.get(image_hash)
                if state is None:
                    state = self.partial[image_hash] = self.model.encoder_begin(feature)
                self.model.encoder_layers_run(state, layers)

    def reset(self) -> None:
        self.requests.clear()
        self.entries.clear()
        self.partial.clear()

    def step_inputs(self, batch: InputBatch, plan: StepPlan, positions: torch.Tensor
                    ) -> tuple[torch.Tensor, tuple | None, dict[int, list[tuple[int, int]]]]:
        """(positions on the device: [3, T] under M-RoPE, else `positions` (the step's [T]); (rows [M], embeddings
        [M, hidden]) or None; image spans: batch row -> [(offset, end)] of the images its chunk computes, for a
        model whose image tokens attend both ways, else {}) for the scheduled chunks. Call before the forward,
        while each request's num_computed_tokens is the chunk's start."""
        pos_parts, rows, embeds, spans, base = [], [], [], {}, 0
        for row, (handle, n) in enumerate(zip(plan.scheduled_handles, plan.num_scheduled_tokens)):
            c = batch[handle].num_computed_tokens
            images = self.requests.get(handle)
            if self.mrope:
                pos_parts.append(self._positions(images, c, n))
            for f in images.features if images is not None else ():
                lo, hi = max(f.offset, c), min(f.end, c + n)
                if lo < hi:
                    rows.append(np.arange(base + lo - c, base + hi - c))
                    embeds.append(self._embeddings(f, images.traceparent)[lo - f.offset:hi - f.offset])
                    if self.images_whole:
                        spans.setdefault(row, []).append(_whole_span(f, c, n))
            base += n
        if self.mrope:
            positions = torch.from_numpy(np.concatenate(pos_parts, axis=1)).to(self.device)
        if not rows:
            return positions, None, spans
        row_t = torch.from_numpy(np.concatenate(rows)).to(self.device)
        return positions, (row_t, torch.cat(embeds)), spans

    @staticmethod
    def _positions(images: _RequestImages | None, c: int, n: int) -> np.ndarray:
        """[3, n] positions of token indices c .. c + n - 1 (drafts included: they follow the prompt)."""
        idx = np.arange(c, c + n)
        if images is None:
            return np.broadcast_to(idx, (3, n))
        num_prompt = images.prompt_positions.shape[1]
        out = np.broadcast_to(idx + images.delta, (3, n)).copy()
        in_prompt = idx < num_prompt
        out[:, in_prompt] = images.prompt_positions[:, idx[in_prompt]]
        return out

    def _embeddings(self, feature: MultiModalFeature, traceparent: str) -> torch.Tensor:
        cached = self.entries.get(feature.hash)
        if cached is None:
            state = self.partial.pop(feature.hash, None)
            with _encode_span(feature, traceparent, -1 if state is None else 0):
                cached = self.model.encode_image(feature) if state is None else self.model.encoder_end(state)
            self.entries[feature.hash] = cached
            self.num_encoded += 1
        return cached


def _whole_span(feature: MultiModalFeature, start: int, num_new: int) -> tuple[int, int]:
    """The image's [offset, end): the chunk [start, start + num_new) must reach its end (its tokens attend to
    each other both ways: the keys after a query must be computed with it)."""
    if start + num_new < feature.end:
        raise ValueError(f"image {feature.hash[:12]}: the chunk [{start}, {start + num_new}) ends inside its "
                         f"placeholder range [{feature.offset}, {feature.end}), which this model attends as a whole")
    return feature.offset, feature.end


def _encode_span(feature: MultiModalFeature, traceparent: str, layers: int):
    """A "steploop.worker.encode_image" span in the request's trace (tracing on and the request traced): the
    vision tower's run on one image (layers -1: whole; 0: what a slice left; n: a slice of n layers). On a GPU it
    times the kernel launches (the step's forward waits for them)."""
    if not tracing.ENABLED or not traceparent:
        return contextlib.nullcontext()
    return tracing.tracer().start_as_current_span(
        "steploop.worker.encode_image", context=tracing.context_from_traceparent(traceparent),
        attributes={tracing.SERVICE: "worker", "steploop.image_hash": feature.hash,
                    "steploop.image_tokens": feature.length, "steploop.image_grid_thw": list(feature.grid_thw),
                    "steploop.encoder_slice_layers": layers})
