"""benchmarks/vlm_images.py measures what it says, on a tiny image: the 'same image' requests of the TTFT scenario
hit the prefix cache and never reach the encoder (whole or in slices); the ITL scenario collects every text stream's
gaps."""

from __future__ import annotations

import pytest

from benchmarks import vlm_images


@pytest.fixture(scope="module")
def runner(vlm_folder):
    return vlm_images.build_runner(vlm_folder)


def test_same_image_requests_skip_the_encoder(runner):
    out = vlm_images.ttft_same_vs_new(runner, rounds=1, size=56)
    assert len(out["wall"]["ttft_s"]["same"]) == len(out["cpu"]["ttft_s"]["new"]) == 2
    assert out["images_encoded"] == 6          # 4 first requests + 2 new images; the 2 'same' ones: none
    assert out["prefix_hit_tokens"] > 0


def test_itl_collects_each_streams_gaps_with_images_arriving(runner):
    gaps = vlm_images.itl_with_images(runner, True, streams=2, tokens=5, every=2, size=56, budget=64)
    assert len(gaps) == 2 * 4 and all(wall > 0 and cpu >= 0 for wall, cpu in gaps)


def test_the_sliced_mode_encodes_in_slices(runner):
    out = vlm_images.ttft_same_vs_new(runner, rounds=1, size=56, encoder_budget=1)
    assert out["images_encoded"] == 6 and out["encoder_slices"] >= 6     # a layer per step: each new image sliced
