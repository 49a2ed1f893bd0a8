"""What the GPU check needs beside the tracked tree: the protobuf stubs (services/common/pb, git-ignored, made by
grpcio-tools, which the GPU machine lacks), made here and carried, and the pure-Python packages the worker imports
that the GPU machine's image lacks (gguf: the worker's GGUF reader and the kernels section's reference), copied into
.gpu-bundle/site, which the check puts on its path.

    make gpu-bundle     (= python -m benchmarks.readiness_stubs)

regenerates the stubs, drops their protobuf runtime-version guard (the generator here is newer than the device's
runtime may be; the serialized descriptors and the builder API they use load on protobuf 4.21+), stamps them with a
hash of protos/ (file times do not survive the copy to the device, so the check compares contents), and prints the
size of what travels: the files git tracks or does not ignore, plus the stubs. The device copy must be given
`carry: ["services/common/pb", ".gpu-bundle"]` (benchmarks/GPU_READINESS.md).
"""

from __future__ import annotations

import hashlib
import importlib.util
import pathlib
import re
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROTOS = ROOT / "protos"
STUBS = ROOT / "services" / "common" / "pb"
STAMP = STUBS / "PROTOS_SHA256"
LIMIT_BYTES = 64 * 2**20
BUNDLE_SITE = ROOT / ".gpu-bundle" / "site"
# Imported by the worker (model_runner -> gguf reader) or the check, absent from the GPU image (device KINDS.md's
# package list); pure Python, so a copy of the installed package runs on the device's Python 3.12.
BUNDLED_PACKAGES = ["gguf"]
CARRY = ["services/common/pb", ".gpu-bundle"]


def protos_hash(protos: pathlib.Path = PROTOS) -> str:
    h = hashlib.sha256()
    for path in sorted(protos.rglob("*.proto")):
        h.update(str(path.relative_to(protos)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def check_stubs(stubs: pathlib.Path = STUBS, protos: pathlib.Path = PROTOS) -> dict:
    """{'ok': bool, 'error': how to fix}: stubs present and stamped with the current protos. Stubs that do not
    import here are reported as import_error without stopping the check: preflight and kernels do not need them
    (the in-process worker sections do: step_contract imports worker_pb2)."""
    fix = 'run `make gpu-bundle` here and pass carry: ["services/common/pb", ".gpu-bundle"] to the device run'
    stamp = stubs / STAMP.name
    if not any(stubs.rglob("*_pb2.py")):
        return {"ok": False, "error": f"protobuf stubs missing under {stubs}: {fix}"}
    if not stamp.is_file():
        return {"ok": False, "error": f"protobuf stubs under {stubs} carry no {stamp.name} stamp: {fix}"}
    if stamp.read_text().strip() != protos_hash(protos):
        return {"ok": False, "error": f"protobuf stubs under {stubs} are older than protos/: {fix}"}
    try:
        from steploop.common.pb.steploop.v1 import engine_pb2, worker_pb2  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - e.g. a protobuf runtime older than the stubs' gencode
        return {"ok": True, "import_error": f"protobuf stubs do not import here: {exc!r}"}
    return {"ok": True}


_GUARD_IMPORT = re.compile(r"^from google\.protobuf import runtime_version as _runtime_version\n", re.MULTILINE)
_GUARD_CALL = re.compile(r"^_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)\n", re.MULTILINE)


def relax_runtime_check(text: str) -> str:
    """A generated *_pb2.py without its runtime-version guard (which refuses any runtime older than the generator)."""
    return _GUARD_CALL.sub("", _GUARD_IMPORT.sub("", text))


def travelling_bytes(root: pathlib.Path = ROOT) -> int:
    """Tracked and not-ignored files, plus the carried paths."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           capture_output=True, check=True).stdout.split(b"\0")
    total = sum((root / n.decode()).stat().st_size for n in names if n and (root / n.decode()).is_file())
    return total + sum(p.stat().st_size for c in CARRY for p in (root / c).rglob("*") if p.is_file())


def bundle_packages(site: pathlib.Path = BUNDLE_SITE) -> list[str]:
    """Copies each of BUNDLED_PACKAGES, as installed here, into `site` (replacing what was there)."""
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    for name in BUNDLED_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"gpu-bundle: package {name!r} is not installed here (make install first)")
        shutil.copytree(pathlib.Path(next(iter(spec.submodule_search_locations))), site / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return BUNDLED_PACKAGES


def main() -> int:
    rc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py")], cwd=ROOT, check=False).returncode
    if rc:
        return rc
    bundle_packages()
    for path in STUBS.rglob("*_pb2.py"):
        path.write_text(relax_runtime_check(path.read_text()))
    STAMP.write_text(protos_hash() + "\n")
    status = check_stubs()
    size = travelling_bytes()
    print(f"gpu-bundle: stubs {'ok' if status['ok'] else status['error']}; what travels: {size / 2**20:.1f} MiB "
          f"(limit 64 MiB); carry: {CARRY}")
    return 0 if status["ok"] and size < LIMIT_BYTES else 1


if __name__ == "__main__":
    sys.exit(main())
