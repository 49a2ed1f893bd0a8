"""PNG plots of a benchmark: TTFT and ITL distributions per run, latency vs throughput across request rates.
matplotlib is optional (extra `bench`); without it, plotting is skipped with a note."""

from __future__ import annotations

import pathlib

import numpy as np


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def plot_distributions(runs: list[tuple[str, list]], path: pathlib.Path) -> pathlib.Path | None:
    """runs: (label, [RequestResult]) per run. One figure: TTFT histogram left, ITL histogram right."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for label, results in runs:
        ok = [r for r in results if r.success]
        ttft = np.array([r.ttft for r in ok]) * 1000
        itl = np.array([g for r in ok for g in r.itl]) * 1000
        if len(ttft):
            ax1.hist(ttft, bins=30, alpha=0.6, label=label)
        if len(itl):
            ax2.hist(itl, bins=50, alpha=0.6, label=label)
    ax1.set(title="TTFT", xlabel="ms", ylabel="requests")
    ax2.set(title="ITL", xlabel="ms", ylabel="gaps", yscale="log")
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_rate_sweep(summaries: list[dict], path: pathlib.Path) -> pathlib.Path | None:
    """Latency (median TTFT, median TPOT, mean E2E) against achieved output throughput, one point per rate."""
    plt = _pyplot()
    if plt is None or len(summaries) < 2:
        return None
    x = [s["output_throughput"] for s in summaries]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, title in zip(axes, ("median_ttft_ms", "median_tpot_ms", "mean_e2el_ms"),
                              ("median TTFT", "median TPOT", "mean E2E latency")):
        ax.plot(x, [s[key] for s in summaries], "o-")
        for s, xi in zip(summaries, x):
            ax.annotate(f"{s['request_rate']:g}/s", (xi, s[key]), fontsize=8)
        ax.set(title=title, xlabel="output tok/s", ylabel="ms")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_bars(labels: list[str], values: list[float], title: str, ylabel: str, path: pathlib.Path):
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(labels)), 4))
    ax.bar(range(len(values)), values, color="tab:blue")
    ax.set_xticks(range(len(values)), labels)
    for i, v in enumerate(values):
        ax.annotate(f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=8)
    ax.set(title=title, ylabel=ylabel)
    plt.setp(ax.get_xticklabels(), rotation=15, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
