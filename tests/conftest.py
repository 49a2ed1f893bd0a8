"""Shared fixtures: only `model_dir`, the converted default model (converted on first use, ~30 s)."""

from __future__ import annotations

import pathlib

import pytest


@pytest.fixture(scope="session")
def model_dir() -> pathlib.Path:
    from steploop.common.model_path import default_model_dir, is_model_dir

    path = default_model_dir()
    if not is_model_dir(path):
        from steploop.gpu_worker.gguf_convert import convert_default_model
        convert_default_model(path)
    return path
