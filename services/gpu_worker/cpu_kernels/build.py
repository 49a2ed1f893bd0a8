"""Compile the plain-C CPU kernels of this package into one shared library, once per (sources, flags, compiler,
CPU, instruction set, blocking).

    python -m steploop.gpu_worker.cpu_kernels.build [--isa avx2]   # builds (or finds) it and prints the path

Each .c file is compiled with its own flags (SOURCES) into an object, then all are linked together, so decoder.c
calls the other kernels directly. The kernels' vector width follows the instruction set they are compiled for
(avx512: 16 floats, avx2: 8, generic: 4; see packed_linear.c), so each has code sized to its registers. The ISA
is the best one /proc/cpuinfo shows (host_isa) unless STEPLOOP_CPU_ISA names a lower one (tests build both
x86 variants). The host's own ISA compiles with -march=native; a lower one with that ISA's x86-64 level, tuned
for the host. The packed matmul's blocking comes from cpu_tuning.py (the Xeon's constants on Intel, this CPU's
caches elsewhere). The library lands in $STEPLOOP_CACHE_DIR/kernels/ (default ~/.cache/steploop/kernels) as
steploop_cpu-<isa>-<hash>.so, the hash covering the sources, the flags, `gcc --version`, the ISA and the CPU's
flags line: -march=native code must not run on another CPU (an image moved between hosts rebuilds). gcc works in
a temp folder and the library is renamed into place, so several processes may build at once. No gcc, or a failed
compile: build() logs one warning and returns None (callers fall back to torch); build(strict=True) raises
KernelBuildError with gcc's message instead when a compiler is there (tests: a kernel that does not compile is a
failure, not a skip). $CC, when set, replaces gcc (it must accept gcc's flags, -fopenmp included).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile

from steploop.common import envs
from steploop.common.model_path import cache_dir
from steploop.gpu_worker.cpu_kernels.cpu_tuning import tile_flags

log = logging.getLogger(__name__)


class KernelBuildError(RuntimeError):
    """A compiler is present but the library did not build (gcc's message included)."""


_COMMON = ["-O3", "-fopenmp", "-fPIC"]
# source (a .c file beside this one) -> gcc flags (the ISA's flags come on top, isa_flags)
SOURCES = {
    # -fassociative-math lets gcc vectorize the kernel's sums with a pairwise lane reduction (see the C file)
    "paged_attention": _COMMON + ["-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"],
    # explicit vector types; no reassociation, so each output stays one fma chain in k order
    "packed_linear": _COMMON,
    # products and sums round one by one, as torch's separate elementwise ops do
    "elementwise": _COMMON + ["-ffp-contract=off"],
    "decoder": _COMMON,
    # explicit fmas (intrinsics, fmaf) only: the AVX2 and portable epilogues round alike
    "int8_activations": _COMMON + ["-ffp-contract=off"],
}
HEADERS = ["vector_width.h"]          # included by the sources: part of the library's hash
NAME = "steploop_cpu"
# instruction sets, best first -> (cpuinfo flags it needs, gcc flags when it is not the host's own)
ISAS = {
    "avx512": ({"avx512f", "avx512bw", "avx512dq", "avx512vl", "fma", "f16c", "avx2"},
               ["-march=x86-64-v4", "-mtune=native"]),
    "avx2": ({"avx2", "fma", "f16c"}, ["-march=x86-64-v3", "-mtune=native"]),
    "generic": (set(), ["-march=x86-64-v2", "-mtune=native"]),
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


def host_isa(cpu_flags: str | None = None) -> str:
    """The best instruction set in ISAS that these cpuinfo flags (default: this CPU's) provide; not x86: generic."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return "generic"
    flags = set((_cpu_flags() if cpu_flags is None else cpu_flags).split())
    return next(name for name, (needs, _) in ISAS.items() if needs <= flags)


def runnable_isas() -> list[str]:
    """The instruction sets this CPU can run, best first (e.g. ['avx512', 'avx2', 'generic'])."""
    names = list(ISAS)
    return names[names.index(host_isa()):]


def selected_isa() -> str:
    """STEPLOOP_CPU_ISA when set (it must be one this CPU runs), else the host's best."""
    wanted = os.environ.get(envs.CPU_ISA, "").strip().lower()
    if not wanted:
        return host_isa()
    if wanted not in runnable_isas():
        raise ValueError(f"{envs.CPU_ISA}={wanted!r}: this CPU runs {', '.join(runnable_isas())}")
    return wanted


def isa_flags(isa: str) -> list[str]:
    """gcc flags for an ISA: -march=native for the host's own (what it was tuned with), else that ISA's level."""
    return ["-march=native"] if isa == host_isa() else ISAS[isa][1]


def source_flags(name: str, isa: str) -> list[str]:
    """gcc flags for one source: its own, the ISA's, and for the packed matmul the blocking for this CPU's caches
    (cpu_tuning.py; none on an Intel CPU)."""
    return SOURCES[name] + isa_flags(isa) + (tile_flags(isa) if name == "packed_linear" else [])


def source(name: str) -> pathlib.Path:
    return pathlib.Path(__file__).with_name(f"{name}.c")


def library_path(compiler_version: str, isa: str | None = None) -> pathlib.Path:
    isa = isa or selected_isa()
    parts = [f"{name}\0{' '.join(source_flags(name, isa))}\0{source(name).read_text()}" for name in sorted(SOURCES)]
    headers = [pathlib.Path(__file__).with_name(name).read_text() for name in HEADERS]
    key = "\0".join([*parts, *headers, compiler_version, isa, _cpu_flags()])
    return cache_dir() / "kernels" / f"{NAME}-{isa}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def _compile(gcc: str, out: pathlib.Path, isa: str) -> None:
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objects = []
        for name in SOURCES:
            obj = pathlib.Path(tmp) / f"{name}.o"
            done = subprocess.run([gcc, *source_flags(name, isa), "-c", "-o", str(obj), str(source(name))],
                                  check=False, capture_output=True, text=True)
            if done.returncode:
                raise KernelBuildError(f"gcc failed on {name}.c: {done.stderr.strip()[-500:]}")
            objects.append(str(obj))
        lib = pathlib.Path(tmp) / "lib.so"
        done = subprocess.run([gcc, "-shared", "-fopenmp", "-o", str(lib), *objects], check=False,
                              capture_output=True, text=True)
        if done.returncode:
            raise KernelBuildError(f"linking failed: {done.stderr.strip()[-500:]}")
        os.chmod(lib, 0o755)                             # tempfile's 0700 folder; the library must be readable
        os.replace(lib, out)


def compiler() -> str | None:
    """The C compiler's path ($CC, else gcc), or None when there is none on PATH."""
    return shutil.which(os.environ.get("CC", "gcc"))


def build(isa: str | None = None, strict: bool = False) -> pathlib.Path | None:
    """The compiled library for `isa` (default: selected_isa()), compiling it if it is not cached, or None when it
    cannot be built. strict: a compiler that is there but fails raises KernelBuildError (no compiler: None)."""
    gcc = compiler()
    try:
        isa = isa or selected_isa()
        if gcc is None:
            raise RuntimeError("gcc not found")
        try:
            version = subprocess.run([gcc, "--version"], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            raise KernelBuildError(f"{gcc} --version failed: {exc}") from exc
        path = library_path(version, isa)
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            _compile(gcc, path, isa)
        return path
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as exc:
        if strict and isinstance(exc, KernelBuildError):
            raise
        log.warning("CPU kernels not built (%s); the CPU uses its torch paths instead", exc)
        return None


@functools.cache
def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The library for `isa` (default: selected_isa()) loaded with ctypes (built on first use), or None."""
    path = build(isa)
    return None if path is None else ctypes.CDLL(str(path))


def function(name: str, argtypes: list, restype=ctypes.c_int, isa: str | None = None):
    """The library's C function `name` with its signature declared, or None when the library is not built."""
    lib = load(isa)
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description="build the CPU kernels' library and print its path")
    parser.add_argument("--isa", choices=list(ISAS), default=None, help=f"default: {envs.CPU_ISA} or the host's")
    built = build(parser.parse_args().isa)
    print(built if built else "not built (see the warning above)")
    sys.exit(0 if built else 1)
