"""benchmarks/gpu_readiness.py cannot rot between GPU runs: its dry run executes every section's code on the CPU
(kernels interpreted, a tiny fp32 model against transformers) in subprocesses, as on the GPU; and the stub check
fails early, with the fix, when the carried protobuf stubs are missing or older than protos/."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

from benchmarks import gpu_readiness, readiness_stubs

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow   # ~40 s of CPU: five subprocesses, each importing torch (transformers for three)
def test_dry_run_runs_every_section(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_readiness", "--dry-run", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "readiness.json").read_text())
    sections = data["sections"]
    assert list(sections) == list(gpu_readiness.TIMEOUTS)
    assert all(s["ok"] for s in sections.values()), json.dumps(sections, indent=1)[:4000]
    assert not sections["kernels"]["failed"] and len(sections["kernels"]["cases"]) >= 14
    assert sections["e2e_1b"]["float32"]["agreement"] == 1.0 and sections["e2e_8b"]["max_batch"]["ok"]
    assert sections["e2e_1b"]["float32"]["max_logprob_err"] < 1e-3
    bf16 = sections["e2e_1b"]["bfloat16"]["eager"]                  # judged against fp32, beside transformers bf16
    assert bf16["ok"] and bf16["hf_bf16_logprob_err"] > 0 and "host_profile" in sections["decode"]
    rows = [r for r in sections["decode"]["rows"] if "step_ms" in r]
    assert len(rows) == 4 and all(r["step_ms"] > 0 for r in rows)
    assert data["meta"]["total_s"] > 0 and (tmp_path / "logs" / "kernels.log").is_file()


def test_a_hanging_section_loses_only_itself(tmp_path, monkeypatch):
    monkeypatch.setitem(gpu_readiness.TIMEOUTS, "preflight", 0.01)   # no Python starts that fast
    args = gpu_readiness.parse_args(["--out", str(tmp_path), "--sections", "preflight"])
    value = gpu_readiness.spawn("preflight", args, None)
    assert value["ok"] is False and value["error"] == "timed out after 0.01 s" and "log_tail" in value


def test_unknown_section_is_refused():
    with pytest.raises(SystemExit):
        gpu_readiness.parse_args(["--sections", "kernels,nope"])


def _stub_tree(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    protos, stubs = tmp_path / "protos", tmp_path / "pb"
    shutil.copytree(ROOT / "protos", protos)
    (stubs / "steploop" / "v1").mkdir(parents=True)
    (stubs / "steploop" / "v1" / "engine_pb2.py").write_text("# generated\n")
    return protos, stubs


def test_stub_check_names_the_fix(tmp_path):
    protos, stubs = _stub_tree(tmp_path)
    missing = readiness_stubs.check_stubs(tmp_path / "nothing", protos)
    assert not missing["ok"] and "make gpu-bundle" in missing["error"] and "services/common/pb" in missing["error"]
    unstamped = readiness_stubs.check_stubs(stubs, protos)
    assert not unstamped["ok"] and "stamp" in unstamped["error"]
    (stubs / readiness_stubs.STAMP.name).write_text(readiness_stubs.protos_hash(protos))
    next(protos.rglob("*.proto")).write_text("// changed\n")
    stale = readiness_stubs.check_stubs(stubs, protos)
    assert not stale["ok"] and "older than protos" in stale["error"]


def test_check_stops_before_any_section_without_stubs(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_readiness, "check_stubs", lambda: {"ok": False, "error": "stubs missing: fix"})
    assert gpu_readiness.main(["--out", str(tmp_path)]) == 2
    data = json.loads((tmp_path / "readiness.json").read_text())
    assert data["sections"] == {} and data["meta"]["stubs"]["error"] == "stubs missing: fix"


def test_what_travels_is_under_the_limit():
    assert readiness_stubs.travelling_bytes() < readiness_stubs.LIMIT_BYTES


def test_bundled_stubs_drop_the_runtime_version_guard():
    """The device's protobuf may be older than the generator here (a 6.31 guard refuses a 5.27 runtime; without it
    the same stubs load there: checked by hand with protobuf 5.27.5)."""
    text = (ROOT / "services" / "common" / "pb" / "steploop" / "v1" / "worker_pb2.py").read_text()
    relaxed = readiness_stubs.relax_runtime_check(text)
    assert "_runtime_version" not in relaxed and "AddSerializedFile" in relaxed
    compile(relaxed, "worker_pb2.py", "exec")
    assert readiness_stubs.relax_runtime_check(relaxed) == relaxed


def test_the_check_imports_steploop_from_a_bare_checkout(tmp_path):
    """The device copies the tree and installs nothing: the package (services/ renamed by setup.py) is reached
    through a link the check makes. Run without site-packages, so the editable install here cannot answer."""
    code = ("import importlib.util, sys; from benchmarks import gpu_readiness; assert importlib.util.find_spec("
            "'steploop') is None; folder = gpu_readiness.package_path(); "
            "assert importlib.util.find_spec('steploop.common.sampling_params') is not None; print(folder); "
            "import pathlib; print(pathlib.Path(folder, 'steploop').resolve())")
    proc = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=False, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    folder, target = proc.stdout.split()
    assert pathlib.Path(target) == (ROOT / "services").resolve()
    assert not pathlib.Path(folder).exists() and (ROOT / "services").is_dir()   # the link went at exit, alone
    assert gpu_readiness.package_path() is None          # here steploop is installed: nothing to link


def test_the_bundle_carries_the_packages_the_device_image_lacks(tmp_path):
    site = tmp_path / "site"
    assert readiness_stubs.bundle_packages(site) == ["gguf"]
    assert (site / "gguf" / "quants.py").is_file() and not list(site.rglob("__pycache__"))
    assert ".gpu-bundle" in readiness_stubs.CARRY and "services/common/pb" in readiness_stubs.CARRY


def test_the_oracle_keeps_its_rope_frequencies_fp32(tmp_path):
    """transformers' .to(bfloat16) rounds the rope inverse frequencies too; an fp32 truth upcast from such a model
    rotates by the wrong angles (the first H200 runs judged bf16 against it)."""
    import torch

    from benchmarks import readiness_e2e

    model = readiness_e2e.make_model("tiny", torch.bfloat16, "cpu", tmp_path / "m")
    bufs = {n: b for n, b in model.named_buffers() if n.endswith("inv_freq")}
    assert bufs and all(b.dtype == torch.float32 for b in bufs.values())
    assert next(model.parameters()).dtype == torch.bfloat16
