"""Compile the plain-C CPU kernels of this package into one shared library, once per (sources, flags, compiler, CPU).

    python -m services.gpu_worker.cpu_kernels.build     # builds (or finds) it and prints the path

Each .c file is compiled with its own flags (SOURCES) into an object, then all are linked together, so decoder.c
calls the other kernels directly. The library lands in $STEPLOOP_CACHE_DIR/kernels/ (default
~/.cache/steploop/kernels) under a name hashing the sources, the flags, `gcc --version` and the CPU's flags line:
-march=native code must not run on another CPU (an image moved between hosts rebuilds). gcc works in a temp folder
and the library is renamed into place, so several processes may build at once. No gcc, or a failed compile:
build() logs one warning and returns None (callers fall back to torch). $CC, when set, replaces gcc (it must accept
gcc's flags, -fopenmp included).
"""

from __future__ import annotations

import ctypes
import functools
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

_COMMON = ["-O3", "-march=native", "-fopenmp", "-fPIC"]
# source (a .c file beside this one) -> gcc flags
SOURCES = {
    # -fassociative-math lets gcc vectorize the kernel's sums with a pairwise lane reduction (see the C file)
    "paged_attention": _COMMON + ["-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"],
    # explicit vector types; no reassociation, so each output stays one fma chain in k order
    "packed_linear": _COMMON,
    # products and sums round one by one, as torch's separate elementwise ops do
    "elementwise": _COMMON + ["-ffp-contract=off"],
    "decoder": _COMMON,
}
NAME = "steploop_cpu"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):     # x86, arm
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def source(name: str) -> pathlib.Path:
    return pathlib.Path(__file__).with_name(f"{name}.c")


def library_path(compiler_version: str) -> pathlib.Path:
    parts = [f"{name}\0{' '.join(flags)}\0{source(name).read_text()}" for name, flags in sorted(SOURCES.items())]
    key = "\0".join([*parts, compiler_version, _cpu_flags()])
    return cache_dir() / "kernels" / f"{NAME}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def _compile(gcc: str, out: pathlib.Path) -> None:
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objects = []
        for name, flags in SOURCES.items():
            obj = pathlib.Path(tmp) / f"{name}.o"
            done = subprocess.run([gcc, *flags, "-c", "-o", str(obj), str(source(name))], check=False,
                                  capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"gcc failed on {name}.c: {done.stderr.strip()[-500:]}")
            objects.append(str(obj))
        lib = pathlib.Path(tmp) / "lib.so"
        done = subprocess.run([gcc, "-shared", "-fopenmp", "-o", str(lib), *objects], check=False,
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"linking failed: {done.stderr.strip()[-500:]}")
        os.chmod(lib, 0o755)                             # tempfile's 0700 folder; the library must be readable
        os.replace(lib, out)


def build() -> pathlib.Path | None:
    """The compiled library (compiling it if it is not cached), or None when it cannot be built."""
    gcc = shutil.which(os.environ.get("CC", "gcc"))
    try:
        if gcc is None:
            raise RuntimeError("gcc not found")
        version = subprocess.run([gcc, "--version"], capture_output=True, text=True, check=True).stdout
        path = library_path(version)
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            _compile(gcc, path)
        return path
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("CPU kernels not built (%s); the CPU uses its torch paths instead", exc)
        return None


@functools.cache
def load() -> ctypes.CDLL | None:
    """The library loaded with ctypes (built on first use), or None."""
    path = build()
    return None if path is None else ctypes.CDLL(str(path))


def function(name: str, argtypes: list, restype=ctypes.c_int):
    """The library's C function `name` with its signature declared, or None when the library is not built."""
    lib = load()
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = build()
    print(built if built else "not built (see the warning above)")
    sys.exit(0 if built else 1)
