"""Prefill pacing counts images' encoder work: the step cost model learns seconds per encoder token, and a chunk that
would start an image the step's allowance cannot pay for stops before it (an image larger than a whole allowance
still runs, with the decodes and no other prompt chunk)."""

from __future__ import annotations

import random

import pytest

from steploop.common.mm_inputs import MultiModalFeature
from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import StepPlan, StepResult
from steploop.scheduler.prefill_pacing import PrefillPacer
from steploop.scheduler.request import Request
from steploop.scheduler.step_cost import StepCostModel, attention_pairs
from tests.scheduler.sched_factories import FakeWorker, Run, create_requests, create_scheduler, run_until_idle, step

# A CPU-like machine: 90 ms per step, 1.6 ms per token, 5 ns per (query, key) pair, 2 ms per encoder token.
A, B, C, E = 0.090, 0.0016, 5e-9, 0.002


def true_cost(tokens: int, pairs: float, encoder_tokens: int = 0) -> float:
    return A + B * tokens + C * pairs + E * encoder_tokens


def test_cost_model_learns_the_encoder_cost_and_predicts_with_it():
    model, rng = StepCostModel(), random.Random(1)
    for _ in range(400):
        tokens = rng.randrange(8, 400)
        pairs = tokens * rng.randrange(16, 1024)
        encoder = rng.choice([0, 0, 0, rng.randrange(16, 200)])
        model.observe(tokens, pairs, true_cost(tokens, pairs, encoder) * rng.uniform(0.98, 1.02), encoder)
    assert model.encoder_token_seconds() == pytest.approx(E, rel=0.05)
    assert model.coefficients()[1] == pytest.approx(B, rel=0.05)
    assert model.predict(200, 20_000.0, 144) == pytest.approx(true_cost(200, 20_000.0, 144), rel=0.03)


def test_cost_model_without_images_charges_nothing_for_them():
    model = StepCostModel(min_observations=4)
    assert model.encoder_token_seconds() == 0.0                # nothing fitted yet
    for tokens in (8, 9, 10, 40, 300):
        model.observe(tokens, tokens * 100.0, true_cost(tokens, tokens * 100.0))
    assert model.encoder_token_seconds() == 0.0


class FixedCost:
    """A fitted cost model's answers: a, b, c and e (the pacer reads nothing else)."""

    def __init__(self, a: float, b: float, c: float, e: float) -> None:
        self.coef, self.e = (a, b, c), e

    def coefficients(self):
        return self.coef

    def encoder_token_seconds(self) -> float:
        return self.e

    def observe(self, *args) -> None:
        pass


def pacer_in_a_decoding_step() -> PrefillPacer:
    """Allowance: (1.5 - 1) * (0.1 + 4 * 0.001) = 52 ms = 52 prompt tokens at 1 ms, or 26 encoder tokens at 2 ms."""
    pacer = PrefillPacer(1.5, 16, FixedCost(0.1, 0.001, 0.0, 0.002))
    pacer.begin_step(4)
    pacer.tally_decodes(4, 400)
    pacer.end_step(0)
    pacer.begin_step(4)
    return pacer


def test_a_chunk_pays_for_the_images_it_starts():
    assert pacer_in_a_decoding_step().clip(100, 0) == 52                       # text only, as before
    # an image of 10 at 20: 20 ms of encoder leaves 32 ms: 32 tokens, 12 of them in the image
    assert pacer_in_a_decoding_step().clip(100, 0, [(20, 10)]) == 32
    # an image already cached is not in `images`: costs nothing
    assert pacer_in_a_decoding_step().clip(100, 30, []) == 52


def test_a_chunk_stops_before_an_image_the_allowance_cannot_pay_for():
    pacer = pacer_in_a_decoding_step()
    assert pacer.clip(100, 0, [(20, 30)]) == 20                                # 60 ms of encoder > 52 ms
    assert pacer.num_paced_steps == 1 and pacer.num_deferred_tokens == 80
    pacer = pacer_in_a_decoding_step()
    assert pacer.clip(100, 0, [(10, 10), (30, 10)]) == 30                      # pays for the first, not both


def test_an_image_larger_than_the_allowance_runs_alone_with_the_decodes():
    pacer = pacer_in_a_decoding_step()
    assert pacer.clip(100, 24, [(24, 144)]) == 16        # the first prompt work of the step: min_chunk carries it
    assert pacer.clip(100, 0) == 0                       # it spent the allowance: nothing else joins
    pacer = pacer_in_a_decoding_step()
    assert pacer.clip(8, 0) == 8                         # another chunk spent some of this step first ...
    assert pacer.clip(100, 24, [(30, 144)]) == 6         # ... the guarantee stops before the image: next step
    pacer = pacer_in_a_decoding_step()
    assert pacer.clip(8, 0) == 8
    assert pacer.clip(100, 24, [(24, 144)]) == 0


def feature(image_hash: str, offset: int, length: int) -> MultiModalFeature:
    return MultiModalFeature(image_hash, offset, length, (1, 2, 2 * length), (4 * length, 2), b"\0" * 32 * length)


def image_request(rid: str, offset: int, length: int, tail: int = 8, max_tokens: int = 2) -> Request:
    n = offset + length + tail
    return Request(rid, list(range(100, 100 + n)), sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   mm_features=[feature(rid, offset, length)])


class ImageTimedWorker(FakeWorker):
    """FakeWorker whose results carry the forward time true_cost gives the plan's shape, encoder work included (an
    image is encoded in the step whose chunk first reaches it)."""

    def __init__(self, depth: int = 0, **kw) -> None:
        """depth > 0: a tower of that many layers run in the plans' slices (its layers' share of the image's cost
        each); a chunk reaching the image runs the layers left."""
        super().__init__(**kw)
        self.depth = depth
        self.features: dict[int, list[MultiModalFeature]] = {}
        self.lengths: dict[str, int] = {}
        self.layers_done: dict[str, int] = {}
        self.encoded: set[str] = set()
        # per step: (tokens, pairs, encoder tokens, decode tokens, decode pairs)
        self.shapes: list[tuple[int, float, int, int, float]] = []

    def execute(self, plan: StepPlan) -> StepResult:
        starts = {h: self.held[h].num_computed if h in self.held else 0 for h in plan.scheduled_handles}
        for new in plan.new_requests:
            starts[new.handle] = new.num_computed_tokens
            self.features[new.handle] = new.mm_features
            self.lengths.update((f.hash, f.length) for f in new.mm_features)
        result = super().execute(plan)
        tokens = pairs = encoder = dec_tokens = dec_pairs = 0
        for image, layers in plan.encoder_slices:
            encoder += self.lengths[image] * layers / self.depth
            self.layers_done[image] = self.layers_done.get(image, 0) + layers
        for h, n in zip(plan.scheduled_handles, plan.num_scheduled_tokens):
            p = attention_pairs(n, starts[h] + n)
            tokens, pairs = tokens + n, pairs + p
            if n == 1:
                dec_tokens, dec_pairs = dec_tokens + 1, dec_pairs + p
            for f in self.features.get(h, ()):
                if f.offset < starts[h] + n and starts[h] < f.end and f.hash not in self.encoded:
                    self.encoded.add(f.hash)
                    done = self.layers_done.get(f.hash, 0)
                    encoder += f.length * (1 - done / self.depth) if self.depth else f.length
        self.shapes.append((tokens, pairs, encoder, dec_tokens, dec_pairs))
        result.forward_seconds = true_cost(tokens, pairs, encoder)
        return result


def streams_and_images(depth: int, ratio: float, budget: int):
    """8 streams decoding, then 6 image requests arriving (text before each image; the fourth image, 64 encoder
    tokens = 128 ms, never fits the ~50 ms allowance whole). Returns the shapes of the steps after the streams
    started and the ratio's check per step: (prompt tokens, encoder tokens) of each step over the ratio."""
    sched = create_scheduler(max_num_batched_tokens=512, max_num_seqs=32, block_size=16, num_blocks=600,
                             max_decode_slowdown=ratio, max_num_encoder_input_tokens=budget)
    worker = ImageTimedWorker(depth=depth, block_size=16)
    sched.encoder.depth = depth                              # what the worker's hello sets
    # Warm up the cost model on text prompts and images of several sizes, with nothing decoding beside them.
    for i, (offset, length) in enumerate([(4, 16), (24, 64), (10, 32), (40, 8), (8, 128), (30, 48)]):
        sched.add_request(image_request(f"warm-img{i}", offset, length))
        sched.add_request(create_requests(1, prompt_len=20 + 37 * i, max_tokens=2, prefix=f"warm-txt{i}")[0])
        run_until_idle(sched, worker)
    assert sched.pacer.cost.encoder_token_seconds() == pytest.approx(E, rel=0.1)

    run = Run()
    streams = create_requests(8, prompt_len=[20 + i for i in range(8)], max_tokens=300, ignore_eos=True)
    for r in streams:
        sched.add_request(r)
    for _ in range(20):
        step(sched, worker, run)
    first = len(worker.shapes)
    # Small images (16 encoder tokens: 32 ms) fit the ~50 ms allowance; one of 64 (128 ms) never fits.
    images = [image_request(f"img{i}", 24, 64 if i == 3 else 16) for i in range(6)]
    for i, r in enumerate(images):
        sched.add_request(r)
        for _ in range(6):
            step(sched, worker, run)
    while any(r.request_id not in run.finish for r in images):
        step(sched, worker, run)
        assert len(worker.shapes) < first + 300, "an image request made no progress"
    over = []
    for tokens, pairs, encoder, dec_tokens, dec_pairs in worker.shapes[first:]:
        assert dec_tokens >= 8                               # the streams decode throughout
        if true_cost(tokens, pairs, encoder) > ratio * true_cost(dec_tokens, dec_pairs) * 1.05:
            over.append((tokens - dec_tokens, encoder))
    assert sum(s[2] for s in worker.shapes[first:]) == pytest.approx(5 * 16 + 64)     # each image encoded once
    sched.check_integrity()
    return over


def test_images_arriving_while_streams_decode_keep_steps_within_the_ratio():
    # Only the large image's step goes over: with the decodes and no more than the guaranteed chunk.
    assert streams_and_images(depth=0, ratio=1.5, budget=256) == [(16, 64)]


def test_a_sliced_tower_keeps_every_step_within_the_ratio_at_the_default_budget():
    """Serving's defaults (the encoder budget is the token budget): a new request whose text comes before an image
    the allowance cannot pay for is admitted with that text and its image sliced as the allowance pays, so not even
    the large image's step goes over."""
    assert streams_and_images(depth=4, ratio=1.5, budget=0) == []
