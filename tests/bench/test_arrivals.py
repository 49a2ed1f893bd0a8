"""Arrival processes: Poisson mean rate, gamma burstiness, the concurrency cap."""


import numpy as np
import pytest

from steploop.bench.runner import arrival_intervals


def test_poisson_mean_rate():
    gaps = np.array(arrival_intervals(20000, rate=8.0, burstiness=1.0, seed=3))
    assert gaps.mean() == pytest.approx(1 / 8, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)      # exponential: CV 1


def test_gamma_burstiness_keeps_the_rate_and_changes_the_spread():
    bursty = np.array(arrival_intervals(20000, rate=8.0, burstiness=0.25, seed=3))
    smooth = np.array(arrival_intervals(20000, rate=8.0, burstiness=4.0, seed=3))
    assert bursty.mean() == pytest.approx(1 / 8, rel=0.05) and smooth.mean() == pytest.approx(1 / 8, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)   # CV = 1/sqrt(shape)
    assert smooth.std() / smooth.mean() == pytest.approx(0.5, rel=0.1)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_intervals(5, float("inf")) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_intervals(5, 1.0, burstiness=0)
