from __future__ import annotations

import pytest
import transformers  # noqa: F401 - with torch, before a gateway fixture first imports it with USE_TORCH=0

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


@pytest.fixture(scope="session")
def gemma3_folder(tmp_path_factory):
    from tests.vlm.gemma3_models import build_gemma3
    return build_gemma3(tmp_path_factory.mktemp("gemma3_vlm"))


@pytest.fixture(scope="session")
def gemma3_oracle(gemma3_folder):
    from tests.vlm.gemma3_models import load_oracle as load_gemma3
    return load_gemma3(gemma3_folder)
