"""Encoder work as step work (vision-language models): the scheduler's mirror of the worker's encoder cache.

An image's embeddings are computed by the worker the first time a scheduled chunk reaches its placeholder range
and kept, keyed by the image hash, while some live request still has placeholder tokens of it to compute. This
class decides, per step, which chunks may reach an image:

    clip(request, start, n):  the chunk [start, start + n) stops before the first image it reaches that is not
                              cached (nor encoded earlier this step) when encoding it would exceed the step's
                              encoder budget (`max_num_encoder_input_tokens`) or the cache size (`encoder_cache_size`)
    to_encode(request, start, n): the images the chunk [start, start + n) reaches that the worker would encode
                              (prefill pacing counts their encoder time: prefill_pacing.py)
    commit(request, start, n): the chunk is in the plan: its new images are charged to the budget and cached;
                              images whose placeholder range the chunk completes no longer need this request.
                              Returns the encoder tokens the step will compute for it
    release(request):         finished or preempted: it needs none of its images any more

An entry no live request needs is freed, and the next plan tells the worker (StepPlan.encoder_free_hashes): never
the plan whose chunk completed the image, since the worker applies a plan's frees before its forward.
add_request refuses an image larger than the budget or the cache, which could never run (check()).

whole_images (Gemma 3, from the worker's hello): an image's placeholder tokens attend to each other both ways, so
every one of them must be in the KV cache or in the same forward when any is computed. A chunk then never ends
inside an image's range: it stops before the image, or (starting inside it after a prefix-cache hit) waits, as
vLLM's disable_chunked_mm_input does; check() refuses an image longer than a step's token budget.
"""

from __future__ import annotations

from steploop.common.mm_inputs import MultiModalFeature
from steploop.scheduler.request import Request, RequestRejectedError


class EncoderBudget:
    def __init__(self, budget: int, cache_size: int, step_tokens: int = 0):
        """step_tokens: the most prompt tokens one step may schedule for a request (whole_images checks it)."""
        self.budget, self.cache_size, self.step_tokens = budget, cache_size, step_tokens
        self.whole_images = False               # chunks never end inside an image (Gemma 3's bidirectional mask)
        self.users: dict[str, set[str]] = {}    # cached image hash -> ids of live requests still prefilling it
        self.sizes: dict[str, int] = {}         # cached image hash -> embeddings it holds
        self.left = budget                      # of this step's encoder budget
        self._freed: list[str] = []
        self.num_encoded = 0                    # images sent to the encoder since start (metrics, tests)
        self.num_queries = 0                    # images a request's chunk first reached (metrics)
        self.num_hits = 0                       # of those, already in the cache: not encoded again

    @property
    def num_entries(self) -> int:
        return len(self.sizes)

    @property
    def used(self) -> int:
        return sum(self.sizes.values())

    def check(self, request: Request) -> None:
        for i, f in enumerate(request.mm_features):
            if f.length > min(self.budget, self.cache_size):
                raise RequestRejectedError(
                    f"image {i} needs {f.length} encoder tokens, more than the scheduler's encoder budget "
                    f"({self.budget}) or cache ({self.cache_size}); send a smaller image or raise "
                    "--max-num-encoder-input-tokens / --encoder-cache-size", "invalid_value", "messages")
            if self.whole_images and 0 < self.step_tokens < f.length:
                raise RequestRejectedError(
                    f"image {i} has {f.length} placeholder tokens, more than one step schedules ({self.step_tokens}): "
                    "this model's image tokens attend to each other, so an image is prefilled in one chunk; raise "
                    "--max-num-batched-tokens (and --long-prefill-token-threshold)", "invalid_value", "messages")

    def begin_step(self) -> None:
        self.left = self.budget

    def take_freed(self) -> list[str]:
        freed, self._freed = self._freed, []
        return freed

    def clip(self, request: Request, start: int, num_new: int) -> int:
        if self.whole_images:
            num_new = whole_image_chunk(request.mm_features, start, num_new)
        need, new_hashes = 0, set()
        for f in _reached(request.mm_features, start, start + num_new):
            if f.hash in self.sizes or f.hash in new_hashes:
                continue
            if need + f.length > self.left or self.used + need + f.length > self.cache_size:
                return f.offset - start if f.offset > start else 0
            need += f.length
            new_hashes.add(f.hash)
        return num_new

    def to_encode(self, request: Request, start: int, num_new: int) -> list[tuple[int, int]]:
        """(offset, encoder tokens) of each image the chunk reaches that is neither cached nor encoded earlier
        this step, in placeholder order."""
        return [(f.offset, f.length) for f in _reached(request.mm_features, start, start + num_new)
                if f.hash not in self.sizes and f.hash not in self._freed]

    def commit(self, request: Request, start: int, num_new: int) -> int:
        end, encoded = start + num_new, 0
        for f in _reached(request.mm_features, start, end):
            if request.request_id not in self.users.get(f.hash, ()):    # its first chunk reaching this image
                self.num_queries += 1
                self.num_hits += f.hash in self.sizes or f.hash in self._freed
            if f.hash in self._freed:            # freed by an earlier commit, the worker not told yet: keep it
                self._freed.remove(f.hash)
                self.sizes[f.hash], self.users[f.hash] = f.length, set()
            elif f.hash not in self.sizes:
                self.sizes[f.hash], self.users[f.hash] = f.length, set()
                self.left -= f.length
                self.num_encoded += 1
                encoded += f.length
            if f.end > end:
                self.users[f.hash].add(request.request_id)
            else:
                self._drop_user(f.hash, request.request_id)
        return encoded

    def release(self, request: Request) -> None:
        for f in request.mm_features:
            if f.hash in self.users:
                self._drop_user(f.hash, request.request_id)

    def reset(self) -> None:
        """The worker is gone (its cache with it): forget every entry, tell no one."""
        self.users.clear()
        self.sizes.clear()
        self._freed.clear()

    def _drop_user(self, image_hash: str, request_id: str) -> None:
        users = self.users[image_hash]
        users.discard(request_id)
        if not users:
            del self.users[image_hash], self.sizes[image_hash]
            self._freed.append(image_hash)


def whole_image_chunk(features: list[MultiModalFeature], start: int, num_new: int) -> int:
    """num_new clipped so the chunk [start, start + num_new) does not end inside an image's placeholder range:
    it stops before that image (0 when it starts inside it: the request waits for a step with room)."""
    end = start + num_new
    for f in features:
        if f.offset < end < f.end:
            return max(f.offset - start, 0)
    return num_new


def paced_whole_image(features: list[MultiModalFeature], start: int, unpaced: int, paced: int) -> int:
    """Prefill pacing's chunk for a whole-image model: cut inside an image that starts at `start` (or before it,
    after a prefix hit) it could never advance while streams decode, so the rest of that image runs (as an image
    larger than a whole allowance does: with the decodes); cut inside a later image it stops before it (clip)."""
    end = start + paced
    for f in features:
        if 0 < paced and f.offset <= start and end < f.end <= start + unpaced:
            return f.end - start
    return paced


def _reached(features: list[MultiModalFeature], start: int, end: int) -> list[MultiModalFeature]:
    """The images whose placeholder range meets tokens [start, end)."""
    return [f for f in features if f.offset < end and start < f.end]
