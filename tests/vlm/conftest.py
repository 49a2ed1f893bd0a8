from __future__ import annotations

import pytest

from tests.gateway.conftest import (  # noqa: F401 - the text-only gateway fixtures, for test_gateway_images
    fake_engine,
    gateway,
    gateway_config,
    gateway_model_dir,
    reply_ids,
    tokenizer,
)

from tests.vlm.vlm_models import build_qwen2_5_vl, load_oracle, png_bytes, prompt_with_images


@pytest.fixture(scope="session")
def vlm_folder(tmp_path_factory):
    return build_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="session")
def vlm_oracle(vlm_folder):
    return load_oracle(vlm_folder)


@pytest.fixture(scope="session")
def images():
    """Two PNGs of 112x84 (12 placeholder tokens each) and one of 56x140 (10 tokens)."""
    return [png_bytes(112, 84, 1), png_bytes(112, 84, 2), png_bytes(56, 140, 3)]


@pytest.fixture(scope="session")
def two_image_prompt(images):
    return prompt_with_images([images[0], images[2]], [5, 9, 6], seed=1)
