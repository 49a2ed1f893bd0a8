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
add_request refuses an image larger than the cache, or (whole images only) than the budget (check()).

Encoder slices (`depth` > 0, the tower's layers from the worker's hello): an image need not be encoded in the step
whose chunk reaches it. A layer of an image of L placeholder tokens costs L / depth encoder tokens of the budget
(ceil over a slice), so no step runs more than the budget (or, with prefill pacing, what the pacer's allowance
still pays for) of tower work:

    slice(request, f):   the next image a request will reach, not yet fully encoded, gets the layers that what is
                         left of the step's budget pays for (at least one when the step encoded nothing else, so an
                         image larger than the budget progresses); StepPlan.encoder_slices tells the worker, which
                         keeps the hidden state in the entry (cached and freed like a whole one). Planned after a
                         scheduled chunk (commit: the image after its end) and for a running request whose chunk
                         stops before an image (clip).
    completion:          counted here, not reported: the entry's layers_left reaches 0 by slices, or a chunk reaches
                         the image when what is left (layers, then the merger) fits the step: the worker finishes it
                         before the forward. Until then a chunk stops before the image; decodes go on meanwhile.

A waiting request's chunk that starts at an image (a prefix hit up to it) cannot be sliced ahead (the worker has
not seen the request): when nothing else was encoded this step the image runs whole, so it is never stuck.

whole_images (Gemma 3, from the worker's hello): an image's placeholder tokens attend to each other both ways, so
every one of them must be in the KV cache or in the same forward when any is computed. A chunk then never ends
inside an image's range: it stops before the image, or (starting inside it after a prefix-cache hit) waits, as
vLLM's disable_chunked_mm_input does; check() refuses an image longer than a step's token budget.
"""

from __future__ import annotations

from steploop.common.mm_inputs import MultiModalFeature
from steploop.scheduler.request import Request, RequestRejectedError, RequestStatus


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
        self.depth = 0                          # the tower's layers, encoded a slice at a time; 0: images whole
        self.pacer = None                       # PrefillPacer: slices also fit its allowance (prefill_pacing.py)
        self.layers_left: dict[str, int] = {}   # partly encoded image hash -> tower layers the worker has not run
        self.slices: list[tuple[str, int]] = []  # this step's (image hash, layers), for StepPlan.encoder_slices
        self.num_slices = 0                     # slices planned since start (metrics, tests)

    @property
    def num_entries(self) -> int:
        return len(self.sizes)

    @property
    def used(self) -> int:
        return sum(self.sizes.values())

    def check(self, request: Request) -> None:
        for i, f in enumerate(request.mm_features):
            # a tower run a slice per step (depth) takes an image larger than the budget, never than the cache
            if f.length > (self.cache_size if self.depth else min(self.budget, self.cache_size)):
                raise RequestRejectedError(
                    f"image {i} needs {f.length} encoder tokens, more than the scheduler's encoder budget "
                    f"({self.budget}; this model encodes an image in one step) or cache ({self.cache_size}); send "
                    "a smaller image or raise --max-num-encoder-input-tokens / --encoder-cache-size",
                    "invalid_value", "messages")
            if self.whole_images and 0 < self.step_tokens < f.length:
                raise RequestRejectedError(
                    f"image {i} has {f.length} placeholder tokens, more than one step schedules ({self.step_tokens}): "
                    "this model's image tokens attend to each other, so an image is prefilled in one chunk; raise "
                    "--max-num-batched-tokens (and --long-prefill-token-threshold)", "invalid_value", "messages")

    def check_entries(self) -> None:
        """Every entry has a live user (else it leaks), partial state only for an entry or a pending free."""
        if set(self.sizes) != set(self.users) or not all(self.users.values()):
            raise AssertionError(f"encoder entries without users: sizes {self.sizes}, users {self.users}")
        if not set(self.layers_left) <= set(self.sizes) | set(self._freed):
            raise AssertionError(f"partial encodes {self.layers_left} without an entry")

    def begin_step(self) -> None:
        self.left = self.budget
        self.slices = []

    def take_freed(self) -> list[str]:
        freed, self._freed = self._freed, []
        for h in freed:                          # the worker drops its partial state with the entry
            self.layers_left.pop(h, None)
        return freed

    def take_slices(self) -> list[tuple[str, int]]:
        slices, self.slices = self.slices, []
        return slices

    def clip(self, request: Request, start: int, num_new: int) -> int:
        num_new, need = self._clip(request, start, num_new)
        if self.depth and not need and request.status is RequestStatus.RUNNING:    # the worker has its pixels
            self._slice_ahead(request, start + num_new)     # (commit slices after a chunk that encodes)
        return num_new

    def _clip(self, request: Request, start: int, num_new: int) -> tuple[int, int]:
        """(the chunk's tokens, encoder tokens it would run)."""
        if self.whole_images:
            num_new = whole_image_chunk(request.mm_features, start, num_new)
        need, new_hashes = 0, set()
        for f in _reached(request.mm_features, start, start + num_new):
            cost = self._cost(f)
            if cost == 0 or f.hash in new_hashes:
                continue
            fresh = f.hash not in self.sizes and f.hash not in self._freed
            no_room = fresh and self.used + need + f.length > self.cache_size
            if need + cost > self.left or no_room:
                stuck = (self.depth and request.status is not RequestStatus.RUNNING and f.offset <= start
                         and not need and not no_room and not self.slices and self.left == self.budget)
                if not stuck:      # (stuck: a waiting request at the image, nothing else encoded: it runs whole)
                    return max(f.offset - start, 0), need
            need += cost
            new_hashes.add(f.hash)
        return num_new, need

    def to_encode(self, request: Request, start: int, num_new: int) -> list[tuple[int, int]]:
        """(offset, encoder tokens still to run) of each image the chunk reaches that is neither cached nor encoded
        earlier this step, in placeholder order."""
        images = [(f.offset, self._cost(f)) for f in _reached(request.mm_features, start, start + num_new)]
        return [(offset, cost) for offset, cost in images if cost]

    def commit(self, request: Request, start: int, num_new: int) -> int:
        end, encoded = start + num_new, 0
        for f in _reached(request.mm_features, start, end):
            if request.request_id not in self.users.get(f.hash, ()):    # its first chunk reaching this image
                self._count_query(f)
            cost = self._cost(f)
            self._revive(f)
            if f.hash not in self.sizes:
                self._add(f)
            self.layers_left.pop(f.hash, None)    # the worker finishes it before the forward
            self.left -= cost
            encoded += cost
            if f.end > end:
                self.users[f.hash].add(request.request_id)
            else:
                self._drop_user(f.hash, request.request_id)
        if self.depth:
            self._slice_ahead(request, end)
        return encoded

    def _slice_ahead(self, request: Request, end: int) -> None:
        """Slice the first image the request reaches after token `end`."""
        ahead = next((f for f in request.mm_features if f.offset >= end), None)
        if ahead is not None:
            self._slice(request, ahead)

    def _slice(self, request: Request, f: MultiModalFeature) -> None:
        """Plan the layers of image f that the step's budget (and the pacer's allowance) still pays for."""
        if self._cost(f) == 0 or any(h == f.hash for h, _ in self.slices):
            return
        fresh = f.hash not in self.sizes and f.hash not in self._freed
        if fresh and self.used + f.length > self.cache_size:
            return                               # no room for its state yet: it waits
        left = self.left
        affordable = self.pacer.encoder_tokens_affordable() if self.pacer is not None else None
        if affordable is not None:
            left = min(left, affordable)
        todo = self.layers_left.get(f.hash, self.depth)
        layers = min(max(left, 0) * self.depth // f.length, todo)
        if layers == 0 and self.left == self.budget and not self.slices:
            layers = 1                           # a layer larger than the step's budget: alone, it progresses
        if layers == 0:
            return
        self._revive(f)
        if fresh:
            self._count_query(f)
            self._add(f)
            self.users[f.hash].add(request.request_id)
        elif request.request_id not in self.users[f.hash]:
            self._count_query(f)
            self.users[f.hash].add(request.request_id)
        cost = -(-f.length * layers // self.depth)
        self.left -= cost
        if self.pacer is not None:
            self.pacer.spend_encoder(cost)
        self.layers_left[f.hash] = todo - layers
        self.slices.append((f.hash, layers))
        self.num_slices += 1

    def _cost(self, f: MultiModalFeature) -> int:
        """Encoder tokens still to run for image f: its layers left (ceil), 0 when encoded (or freed, its
        embeddings still on the worker), all of it when not started."""
        if f.hash in self.layers_left:
            return -(-f.length * self.layers_left[f.hash] // self.depth)
        return 0 if f.hash in self.sizes or f.hash in self._freed else f.length

    def _revive(self, f: MultiModalFeature) -> bool:
        """Freed by an earlier commit, the worker not told yet: keep it (partial state too)."""
        if f.hash not in self._freed:
            return False
        self._freed.remove(f.hash)
        self.sizes[f.hash], self.users[f.hash] = f.length, set()
        return True

    def _add(self, f: MultiModalFeature) -> None:
        self.sizes[f.hash], self.users[f.hash] = f.length, set()
        self.num_encoded += 1

    def _count_query(self, f: MultiModalFeature) -> None:
        self.num_queries += 1
        self.num_hits += f.hash in self.sizes or f.hash in self._freed

    def release(self, request: Request) -> None:
        for f in request.mm_features:
            if f.hash in self.users:
                self._drop_user(f.hash, request.request_id)

    def reset(self) -> None:
        """The worker is gone (its cache with it): forget every entry, tell no one."""
        self.users.clear()
        self.sizes.clear()
        self._freed.clear()
        self.layers_left.clear()
        self.slices.clear()

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
