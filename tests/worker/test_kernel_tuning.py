"""The start-up tuner's logic (kernels/tuning.py) with a fake clock: the fastest candidate per shape class wins,
a candidate that fails is skipped, the choice is cached per device and shape, and the plans carry it. The real
timing runs on the GPU (benchmarks/gpu_readiness.py, kernels section; its dry run runs it interpreted)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from steploop.gpu_worker.attention.triton_backend import TritonAttentionBackend
from steploop.gpu_worker.kernels import tuning
from steploop.gpu_worker.kernels.paged_attention import plan_attention
from steploop.gpu_worker.kernels.tuning import LaunchConfig


@pytest.fixture
def fake_clock(monkeypatch):
    """Seconds per (class, config): the timer sees which problem a launch closure was made for."""
    speeds = {"decode": {LaunchConfig(2, 2): 1.0, LaunchConfig(8, 2): 3.0},
              "split": {LaunchConfig(4, 3): 0.5},
              "mixed": {LaunchConfig(8, 3): 0.2}}
    made = []

    def make_launch(backend, problem, kv_cache, block_size, config, window=None, softcap=None, q_dtype=None):
        cls = tuning.shape_class(max(problem.query_lens), problem.num_splits)
        made.append((cls, config))
        return cls, config

    def time_launch(launch, reps=5):
        cls, config = launch
        if config == LaunchConfig(4, 2) and cls == "decode":
            raise RuntimeError("out of resources")
        return speeds[cls].get(config, 2.0)

    monkeypatch.setattr(tuning, "make_launch", make_launch)
    monkeypatch.setattr(tuning, "time_launch", time_launch)
    return made


def test_fastest_candidate_per_class_is_kept_and_cached(fake_clock, tmp_path):
    backend = TritonAttentionBackend(32, 8, 128, 0.1)
    cache = torch.zeros((2, 4, 16, 8, 128))
    path = tmp_path / "tuning.json"
    report = tuning.tune_attention(backend, cache, 16, 32768, cache_path=path)
    assert backend.launch == {"decode": LaunchConfig(2, 2), "split": LaunchConfig(4, 3), "mixed": LaunchConfig(8, 3)}
    assert "out of resources" in report["classes"]["decode"]["failed"]["w4s2"]
    assert not report["from_cache"] and len(fake_clock) == 12
    other = TritonAttentionBackend(32, 8, 128, 0.1)
    again = tuning.tune_attention(other, cache, 16, 32768, cache_path=path)
    assert again["from_cache"] and other.launch == backend.launch and len(fake_clock) == 12   # nothing timed
    bf16 = TritonAttentionBackend(32, 8, 128, 0.1)
    assert not tuning.tune_attention(bf16, cache.bfloat16(), 16, 32768, cache_path=path)["from_cache"]


def test_a_class_where_nothing_runs_is_an_error(fake_clock, monkeypatch, tmp_path):
    monkeypatch.setitem(tuning.CANDIDATES, "decode", (LaunchConfig(4, 2),))
    with pytest.raises(RuntimeError, match="no launch configuration of the decode"):
        tuning.tune_attention(TritonAttentionBackend(4, 2, 32, 0.1), torch.zeros((2, 4, 16, 2, 32)), 16, 1024,
                              cache_path=tmp_path / "t.json")


def test_plans_carry_the_tuned_config_of_their_class():
    launch = {"decode": LaunchConfig(2, 2), "split": LaunchConfig(4, 3), "mixed": LaunchConfig(8, 3)}
    z = torch.zeros(4, dtype=torch.int32)

    def plan(query_lens, seq_lens, splits):
        q, s = np.array(query_lens, np.int32), np.array(seq_lens, np.int32)
        return plan_attention(z, z[:len(s)], z[:len(s), None], q, s, 32, 8, splits, launch=launch).launch

    assert plan([1, 1], [9, 9], 1) == LaunchConfig(2, 2)
    assert plan([1, 1], [9, 9], 4) == LaunchConfig(4, 3)
    assert plan([5, 1], [9, 9], 1) == LaunchConfig(8, 3)
    q = np.ones(1, np.int32)
    assert plan_attention(z, z[:1], z[:1, None], q, q, 32, 8, 1).launch == tuning.DEFAULT


def test_warm_up_covers_every_split_count_and_layer_variant(monkeypatch):
    runs = []
    monkeypatch.setattr(tuning, "make_launch", lambda backend, problem, cache, bs, config, window=None,
                        softcap=None, q_dtype=None: lambda: runs.append((problem.num_splits, window, softcap, config)))
    backend = TritonAttentionBackend(4, 2, 32, 0.1)
    backend.serve_variant(0, 8, None)
    backend.serve_variant(1, None, 30.0)
    backend.launch["split"] = LaunchConfig(2, 2)
    done = tuning.warm_up_attention(backend, torch.zeros((2, 4, 16, 2, 32)), 16)
    assert len(done) == len(runs) == (2 + len(tuning.SPLITS)) * 3      # (decode, mixed, 4 splits) x 3 variants
    assert {r[0] for r in runs} == {1, 2, 4, 8, 16}
    assert {(r[1], r[2]) for r in runs} == {(None, None), (8, None), (None, 30.0)}
    assert all(r[3] == LaunchConfig(2, 2) for r in runs if r[0] > 1)
