"""Compile the plain-C CPU kernels of this package into a shared library, once per (source, flags, compiler, CPU).

    python -m services.gpu_worker.cpu_kernels.build     # builds (or finds) it and prints the path

The library lands in $STEPLOOP_CACHE_DIR/kernels/ (default ~/.cache/steploop/kernels) under a name hashing the
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

SOURCE = pathlib.Path(__file__).with_name("paged_attention.c")
# -fassociative-math lets gcc vectorize the kernel's sums with a pairwise lane reduction (see paged_attention.c)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
         "-shared", "-fPIC"]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):     # x86, arm
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def library_path(compiler_version: str) -> pathlib.Path:
    key = "\0".join([SOURCE.read_text(), " ".join(FLAGS), compiler_version, _cpu_flags()])
    return cache_dir() / "kernels" / f"{SOURCE.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def build() -> pathlib.Path | None:
    """The compiled library's path (compiling it if it is not cached), or None when it cannot be built."""
    gcc = shutil.which(os.environ.get("CC", "gcc"))
    try:
        if gcc is None:
            raise RuntimeError("gcc not found")
        version = subprocess.run([gcc, "--version"], capture_output=True, text=True, check=True).stdout
        path = library_path(version)
        if path.is_file():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            done = subprocess.run([gcc, *FLAGS, "-o", tmp, str(SOURCE)], check=False, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"gcc failed: {done.stderr.strip()[-500:]}")
            os.chmod(tmp, 0o755)                          # mkstemp's 0600 would hide it from other users
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("CPU attention kernel not built (%s); the CPU uses the torch gather + SDPA path", exc)
        return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = build()
    print(built if built else "not built (see the warning above)")
    sys.exit(0 if built else 1)
