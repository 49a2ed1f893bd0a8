"""The CPU-safe parts of benchmarks/gpu_check: shell syntax, argument parsing, the partial-JSON writer."""

from __future__ import annotations

import json
import pathlib
import subprocess

import pytest

from benchmarks import gpu_check

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_shell_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")], check=True)


def test_args():
    args = gpu_check.parse_args(["--sections", "e2e,copy", "--iters", "5"])
    assert args.sections == ["copy", "e2e"] and args.iters == 5
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--sections", "nope"])


def test_report_written_after_each_section(tmp_path):
    out = tmp_path / "r.json"
    assert gpu_check.main(["--dry-run", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["dry_run"] and data["meta"]["sections_requested"] == list(gpu_check.SECTIONS)
    report = gpu_check.Report(out, {"x": 1})
    report.put("copy", {"gb_per_s": 1.5})
    report.put("attention", [{"batch": 64}])
    assert json.loads(out.read_text())["sections"] == {"copy": {"gb_per_s": 1.5}, "attention": [{"batch": 64}]}
    assert not out.with_suffix(".tmp").exists()
