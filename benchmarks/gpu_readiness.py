"""The GPU readiness check: one command, ~7-8 minutes on one H200 (benchmarks/GPU_READINESS.md has the exact device
`run` line). Writes $OUT/readiness.json (or --out DIR), rewritten after every section.

    python -m benchmarks.gpu_readiness [--out DIR] [--sections a,b] [--dry-run]

Sections, each in its own subprocess under its own timeout (a crash or a hang loses that section only; its log is
DIR/logs/<section>.log):
    preflight  versions, device, copy bandwidth (H2D pinned, D2H pinned, D2D), bf16 GEMM rate, the stubs import
    kernels    every Triton kernel against its fp32 torch reference at serving shapes (readiness_kernels.py)
    e2e_1b     ModelRunner vs transformers, a Llama-3.2-1B-shaped model with random weights (readiness_e2e.py)
    e2e_8b     the same at Llama-3-8B width (8 layers), plus one largest-batch step with the KV cache sized by memory
    decode     decode step time at batch 1-128 x context 1k/4k/32k against the HBM bandwidth bound
Nothing is downloaded or installed: models are hand-written configs with random weights made on the GPU.
--dry-run runs every section's code on the CPU at tiny shapes (kernels interpreted, fp32); tests/worker runs it.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

from benchmarks.readiness_stubs import BUNDLE_SITE, check_stubs

ROOT = pathlib.Path(__file__).resolve().parents[1]
# section -> seconds allowed on the GPU (sum 555 s; the first H200 runs took 10 + 40 + 48 + 56 + 21 s, the decode
# section then on 8 layers: an upper bound that leaves a rerun inside the 15 device minutes)
TIMEOUTS = {"preflight": 45, "kernels": 150, "e2e_1b": 100, "e2e_8b": 120, "decode": 140}
DRY_TIMEOUT = 120
NOMINAL_HBM_GBS = 4800.0    # H200 HBM3e, for the bound when preflight's copy figure is missing


def package_path() -> str | None:
    """A folder that makes `import steploop` work from a bare checkout (the device copies the tree and installs
    nothing, and the package is `services/` renamed by setup.py): a link steploop -> services in a temporary folder,
    put on sys.path here and on each section's PYTHONPATH, removed when the check exits. None where steploop
    already imports (an install)."""
    if importlib.util.find_spec("steploop") is not None:
        return None
    folder = pathlib.Path(tempfile.mkdtemp(prefix="steploop-pkg-"))
    atexit.register(shutil.rmtree, folder, True)        # the link only: rmtree does not follow it
    (folder / "steploop").symlink_to(ROOT / "services", target_is_directory=True)
    sys.path.insert(0, str(folder))
    return str(folder)


class Report:
    """readiness.json, rewritten atomically after each section so a killed run leaves what it had."""

    def __init__(self, path: pathlib.Path, meta: dict):
        self.path, self.data = path, {"meta": meta, "sections": {}}
        path.parent.mkdir(parents=True, exist_ok=True)
        self.write()

    def put(self, name: str, value) -> None:
        self.data["sections"][name] = value
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(tmp, self.path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT") or ROOT / "benchmarks"
                                                                    / "results"), help="folder for readiness.json")
    p.add_argument("--sections", default=",".join(TIMEOUTS), help=f"comma list of {', '.join(TIMEOUTS)}")
    p.add_argument("--dry-run", action="store_true", help="every section on the CPU at tiny shapes")
    p.add_argument("--skip-stub-check", action="store_true", help="run without the protobuf stubs")
    p.add_argument("--section", help=argparse.SUPPRESS)          # child mode: run one section
    p.add_argument("--section-out", type=pathlib.Path, help=argparse.SUPPRESS)
    p.add_argument("--hbm-gbs", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    bad = set(args.sections) - set(TIMEOUTS)
    if bad:
        p.error(f"unknown sections {sorted(bad)}; choose from {', '.join(TIMEOUTS)}")
    return args


def run_section(name: str, args: argparse.Namespace) -> dict:
    """Child side: compute one section and return its JSON value."""
    if name == "preflight":
        from benchmarks.readiness_preflight import preflight
        return preflight(args.dry_run)
    if name == "kernels":
        from benchmarks.readiness_kernels import run
        return run(args.dry_run)
    from benchmarks import readiness_e2e
    if name in ("e2e_1b", "e2e_8b"):
        return readiness_e2e.e2e("tiny" if args.dry_run else name.removeprefix("e2e_"), args.dry_run)
    return readiness_e2e.decode(args.dry_run, args.hbm_gbs)


def spawn(name: str, args: argparse.Namespace, hbm_gbs: float | None, pkg: str | None = None) -> dict:
    """Parent side: one subprocess per section; its env runs kernels interpreted in a dry run."""
    part = args.out / "parts" / f"{name}.json"
    log = args.out / "logs" / f"{name}.log"
    part.parent.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    part.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    bundle = str(BUNDLE_SITE) if BUNDLE_SITE.is_dir() else None     # make gpu-bundle's packages (gguf)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), pkg, env.get("PYTHONPATH"), bundle]))
    if args.dry_run and name == "kernels":
        env["TRITON_INTERPRET"] = "1"       # read when a kernel module is imported: only this child sees it
    cmd = [sys.executable, "-m", "benchmarks.gpu_readiness", "--section", name, "--section-out", str(part)]
    cmd += ["--dry-run"] if args.dry_run else []
    cmd += ["--hbm-gbs", str(hbm_gbs)] if hbm_gbs else []
    limit = DRY_TIMEOUT if args.dry_run else TIMEOUTS[name]
    start = time.perf_counter()
    with log.open("w") as log_file:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                  timeout=limit, check=False)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    seconds = round(time.perf_counter() - start, 1)
    if rc == 0 and part.is_file():
        value = json.loads(part.read_text())
        part.unlink()                      # it lives on in readiness.json; the device returns at most 8 files
        return {**value, "seconds": seconds}
    why = f"timed out after {limit} s" if rc is None else f"exit code {rc}"
    return {"ok": False, "error": why, "seconds": seconds, "log_tail": log.read_text()[-3000:]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.section:
        value = run_section(args.section, args)
        args.section_out.write_text(json.dumps(value, default=str))
        return 0
    pkg = package_path()
    stubs = check_stubs()
    report = Report(args.out / "readiness.json", {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                                  "dry_run": args.dry_run, "sections": args.sections,
                                                  "stubs": stubs})
    if not stubs["ok"] and not (args.dry_run or args.skip_stub_check):
        print(f"[gpu_readiness] {stubs['error']}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    hbm = None
    for name in args.sections:
        value = spawn(name, args, hbm, pkg)
        report.put(name, value)
        if name == "preflight":
            hbm = (value.get("copy") or {}).get("d2d_gb_per_s") or (None if args.dry_run else NOMINAL_HBM_GBS)
        print(f"[gpu_readiness] {name}: {value.get('seconds')} s, ok={value.get('ok')}", flush=True)
    report.data["meta"]["total_s"] = round(time.perf_counter() - t0, 1)
    report.data["meta"]["ok"] = all(v.get("ok", True) for v in report.data["sections"].values())
    report.write()
    print(f"[gpu_readiness] {report.path}: ok={report.data['meta']['ok']}, {report.data['meta']['total_s']} s")
    return 0 if report.data["meta"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
