"""Fixtures for integration tests: a real cluster (three processes, real gRPC and HTTP) and the HF oracle."""

from __future__ import annotations

import pytest

from tests.integration.cluster import Cluster
from tests.integration.hf_reference import HFReference


@pytest.fixture(scope="session")
def hf(model_dir) -> HFReference:
    return HFReference(model_dir)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory, model_dir):
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture(scope="session")
def small_budget_cluster(tmp_path_factory, model_dir):
    """Budget 16 tokens per step: every prompt is chunked, decodes share steps with prompt chunks."""
    c = Cluster(tmp_path_factory.mktemp("cluster16"), scheduler_args=["--max-num-batched-tokens", "16", "--max-num-seqs", "16"])
    try:
        yield c.start()
    finally:
        c.stop()
