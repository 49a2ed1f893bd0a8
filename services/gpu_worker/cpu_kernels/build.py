"""Compile each plain-C CPU kernel of this package into its own shared library, once per (source, flags, compiler,
CPU).

    python -m services.gpu_worker.cpu_kernels.build     # builds (or finds) every kernel and prints the paths

A library lands in $STEPLOOP_CACHE_DIR/kernels/ (default ~/.cache/steploop/kernels) under a name hashing the
source, the flags, `gcc --version` and the CPU's flags line: -march=native code must not run on another CPU (an
image moved between hosts rebuilds). gcc writes to a temp file that is renamed into place, so several processes
may build at once. No gcc, or a failed compile: build() logs one warning and returns None (callers fall back).
$CC, when set, replaces gcc (it must accept gcc's flags, -fopenmp included).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

from services.common.model_path import cache_dir

log = logging.getLogger(__name__)

_COMMON = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
# kernel name (its .c file beside this one) -> gcc flags
KERNELS = {
    # -fassociative-math lets gcc vectorize the kernel's sums with a pairwise lane reduction (see the C file)
    "paged_attention": _COMMON + ["-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"],
    # explicit vector types; no reassociation, so each output stays one fma chain in k order
    "packed_linear": _COMMON,
    # products and sums round one by one, as torch's separate elementwise ops do
    "elementwise": _COMMON + ["-ffp-contract=off"],
}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):     # x86, arm
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def source(kernel: str) -> pathlib.Path:
    return pathlib.Path(__file__).with_name(f"{kernel}.c")


def library_path(kernel: str, compiler_version: str) -> pathlib.Path:
    key = "\0".join([source(kernel).read_text(), " ".join(KERNELS[kernel]), compiler_version, _cpu_flags()])
    return cache_dir() / "kernels" / f"{kernel}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def build(kernel: str) -> pathlib.Path | None:
    """The kernel's compiled library (compiling it if it is not cached), or None when it cannot be built."""
    gcc = shutil.which(os.environ.get("CC", "gcc"))
    try:
        if gcc is None:
            raise RuntimeError("gcc not found")
        version = subprocess.run([gcc, "--version"], capture_output=True, text=True, check=True).stdout
        path = library_path(kernel, version)
        if path.is_file():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            done = subprocess.run([gcc, *KERNELS[kernel], "-o", tmp, str(source(kernel))], check=False, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"gcc failed: {done.stderr.strip()[-500:]}")
            os.chmod(tmp, 0o755)                          # mkstemp's 0600 would hide it from other users
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("CPU kernel %s not built (%s); the CPU uses its torch path instead", kernel, exc)
        return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = {kernel: build(kernel) for kernel in KERNELS}
    for kernel, path in built.items():
        print(f"{kernel}: {path or 'not built (see the warning above)'}")
    sys.exit(0 if all(built.values()) else 1)
