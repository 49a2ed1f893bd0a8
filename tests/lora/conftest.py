"""Fixtures for the LoRA tests: two peft adapters on the default model (made once per session) and the
transformers + peft oracle."""

from __future__ import annotations

import pytest

from tests.lora.adapters import RECIPES, PeftReference, make_adapter


@pytest.fixture(scope="session")
def adapter_dirs(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("adapters")
    return {recipe.name: make_adapter(model_dir, out, recipe) for recipe in RECIPES}


@pytest.fixture(scope="session")
def peft_ref(model_dir, adapter_dirs):
    return PeftReference(model_dir, adapter_dirs)
