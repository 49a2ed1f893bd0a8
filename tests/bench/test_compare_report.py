"""compare_report: every ratio maps to its measured value and target in compare.json; (e) is steploop's 16-stream
run over llama.cpp's 16-stream run; compare.md names the machine and the workload. Synthetic figures only."""

import argparse
import json

import pytest

from benchmarks import compare_report as report
from benchmarks.compare import Workloads


def _run(tput, tpot=200.0, ttft=100.0, completed=128, max_concurrency=64, **extra):
    return {"output_throughput": tput, "mean_tpot_ms": tpot, "mean_ttft_ms": ttft, "completed": completed,
            "max_concurrency": max_concurrency, **extra}


def figures(llama=True):
    f = {
        "matmul_gflops": {"64": 100.0, "256": 120.0}, "params": 100_000_000,
        "hf_one_at_a_time": {"requests": 4, "output_tokens": 256, "seconds": 16.0, "output_throughput": 16.0},
        "hf_static_batch": {"requests": 128, "batch_size": 64, "output_tokens": 8192, "seconds": 80.0,
                            "output_throughput": 100.0},
        "inprocess": _run(210.0, tpot=205.0), "cluster": _run(200.0, tpot=205.5),
        "cluster_16": _run(120.0, tpot=110.0, completed=32, max_concurrency=16),
        "prefix_on": _run(10.0, ttft=100.0), "prefix_off": _run(10.0, ttft=1000.0),
        "misses_on": _run(50.0), "misses_off": _run(50.0),
        "chunked_default": {"p99_over_median": 1.5, "p99_itl_ms": 150.0, "median_itl_ms": 100.0},
        "chunked_whole": {"p99_over_median": 40.0, "p99_itl_ms": 4000.0, "median_itl_ms": 100.0},
    }
    if llama:
        f["llama_cpp_16"] = {"requests": 32, "streams": 16, "output_throughput": 50.0, "mean_tpot_ms": 250.0,
                             "threads": 2, "weights": "Q4_1 GGUF"}
        f["llama_cpp"] = {"requests": 4, "output_throughput": 40.0}
    else:
        f["llama_cpp_16"] = f["llama_cpp"] = {"skipped": "not installed"}
    return f


KEYS = ["a_one_at_a_time", "a_static_batch", "a_share_of_limit", "b_throughput", "b_tpot", "c_prefix_ttft",
        "c_miss_throughput", "d_p99_over_median", "e_llama_cpp_16_streams"]


def test_every_ratio_has_a_key_a_measured_value_and_a_target():
    rows = report.ratios(figures())
    targets = report.targets(rows)
    assert list(targets) == KEYS + ["e_llama_cpp_one_stream"]
    expect = {"a_one_at_a_time": (200 / 16, 6.0), "a_static_batch": (2.0, 1.5),
              "a_share_of_limit": (200 * 2 * 1e8 / 100e9, 0.60), "b_throughput": (200 / 210, 0.92),
              "b_tpot": (0.5, 1.0), "c_prefix_ttft": (10.0, 5.0), "c_miss_throughput": (1.0, 0.99),
              "d_p99_over_median": (1.5, 2.0), "e_llama_cpp_16_streams": (120 / 50, 2.0),
              "e_llama_cpp_one_stream": (120 / 40, None)}
    for key, (measured, target) in expect.items():
        assert targets[key]["measured"] == pytest.approx(measured), key
        assert targets[key]["target"] == target, key
    assert targets["b_throughput"]["pass"] is True and targets["b_tpot"]["pass"] is True
    assert targets["e_llama_cpp_16_streams"]["pass"] is True
    assert targets["e_llama_cpp_one_stream"]["pass"] is None            # informational, no target


def test_e_compares_the_16_stream_runs_not_the_64_concurrent_cluster():
    f = figures()
    f["llama_cpp_16"]["output_throughput"] = 70.0                      # 120 / 70 < 2
    e = report.targets(report.ratios(f))["e_llama_cpp_16_streams"]
    assert e["measured"] == pytest.approx(120 / 70) and e["pass"] is False
    table = report.markdown_table(report.ratios(f))
    assert "| 1.71x | >= 2x | FAIL |" in table
    assert "| 3.00x | — | info |" in table


def test_llama_cpp_not_installed_is_skipped_with_its_target():
    rows = report.ratios(figures(llama=False))
    e = report.targets(rows)["e_llama_cpp_16_streams"]
    assert e == {"name": e["name"], "measured": None, "target": 2.0, "op": ">=", "unit": "x", "pass": None}
    assert "e_llama_cpp_one_stream" not in report.targets(rows)
    assert "| — | >= 2x | skipped |" in report.markdown_table(rows)


def test_workloads_keep_64_in_flight_over_twice_as_many_requests():
    full, quick = Workloads(False), Workloads(True)
    assert (full.concurrency, full.requests, full.hf_batch) == (64, 128, 64)
    assert (quick.concurrency, quick.requests, quick.hf_batch) == (16, 32, 16)
    assert full.llama_streams == quick.llama_streams == 16
    assert quick.llama_output_len < full.llama_output_len


def test_write_maps_ratios_and_describes_machine_and_workload(tmp_path):
    info = {"cpu": "AMD EPYC", "cores": 2, "simd": ["avx2", "fma"], "memory_gib": 23.5, "os": "Linux 6.1",
            "gpu": None, "torch": "2.x", "torch_threads": 2, "engine_threads": 2, "transformers": "4.x",
            "llama_cpp_python": "0.3.36", "python": "3.11.7", "date": "2026-01-01T00:00:00",
            "load_average_at_start": [1.0, 1.0, 1.0], "load_average_at_end": [2.0, 2.0, 2.0], "wall_seconds": 300.0,
            "quick": False}
    rows = report.ratios(figures())
    report.write(tmp_path, info, Workloads(False), figures(), rows)
    doc = json.loads((tmp_path / "compare.json").read_text())
    assert set(KEYS) <= set(doc["targets"])
    assert doc["targets"]["a_share_of_limit"]["target"] == 0.60
    assert doc["workloads"]["requests"] == 128
    md = (tmp_path / "compare.md").read_text()
    assert "Machine: AMD EPYC, 2 cores, avx2/fma, 24 GiB RAM, Linux 6.1, no GPU" in md
    assert "2 threads per engine" in md
    assert "128 requests" in md and "at most 64 in flight" in md and "padded static batches of 64" in md
    assert "32 requests" in md and "at most 16 in flight" in md
    # --replot reads the workloads back from compare.json
    report.write(tmp_path, doc["machine"], argparse.Namespace(**doc["workloads"]), doc["figures"], doc["ratios"])
    assert (tmp_path / "compare.md").read_text() == md


def test_packed_kernel_rate_is_an_informational_row_beside_the_limit():
    f = figures()
    f["packed_gflops"] = {"64": 160.0, "256": 200.0}
    targets = report.targets(report.ratios(f))
    assert list(targets)[:4] == ["a_one_at_a_time", "a_static_batch", "a_share_of_limit", "a_share_of_packed_limit"]
    assert targets["a_share_of_packed_limit"]["measured"] == pytest.approx(200 * 2 * 1e8 / 160e9)
    assert targets["a_share_of_packed_limit"]["target"] is None and targets["a_share_of_limit"]["target"] == 0.60


def test_llama_cpp_row_shows_its_alternating_rounds():
    f = figures()
    f["rounds"] = {"cluster_16": [110.0, 120.0, 115.0], "llama_cpp_16": [48.0, 50.0, 49.0]}
    e = next(r for r in report.ratios(f) if r["key"] == "e_llama_cpp_16_streams")
    assert e["value"] == pytest.approx(120 / 50)
    assert "best of alternating rounds: 110.0, 120.0, 115.0 vs 48.0, 50.0, 49.0" in e["detail"]
    assert Workloads(False).llama_rounds == 3 and Workloads(True).llama_rounds == 1


def test_tpot_row_is_the_mean_of_the_paired_round_differences():
    f = figures()
    f["rounds_tpot_ms"] = {"cluster": [130.0, 125.0, 121.0], "inprocess": [128.0, 124.0, 123.0]}
    b = next(r for r in report.ratios(f) if r["key"] == "b_tpot")
    assert b["value"] == pytest.approx(1 / 3)                   # (2 + 1 - 2) / 3
    assert "mean of 3 back-to-back round differences (2.0, 1.0, -2.0 ms), standard error 1.2 ms" in b["detail"]
    assert "per round 130.0, 125.0, 121.0 vs 128.0, 124.0, 123.0 ms" in b["detail"]
    assert "the best-throughput rounds 205.5 vs 205.0 ms" in b["detail"]
    assert Workloads(False).ab_rounds == 5 and Workloads(True).ab_rounds == 1


def test_tpot_row_of_a_single_round_is_its_difference():
    b = next(r for r in report.ratios(figures()) if r["key"] == "b_tpot")
    assert b["value"] == pytest.approx(0.5) and b["pass"] is True


def test_limit_is_the_better_of_its_two_measurements():
    f = figures()
    f["matmul_gflops_runs"] = [{"64": 114.0, "256": 150.0}, dict(f["matmul_gflops"])]
    a = next(r for r in report.ratios(f) if r["key"] == "a_share_of_limit")
    assert f"the better of 114 and {f['matmul_gflops']['64']:.0f} GFLOP/s, measured first and last" in a["detail"]
