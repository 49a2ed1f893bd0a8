"""The packed matmul's blocking for the CPU it is built on: gcc -D flags for packed_linear.c, read at build time
(which is run time: build.py compiles on the host, and the flags are part of the library's hash).

    tile_flags("avx2")    # [] on Intel; ["-DKC=256", "-DX_BYTES=524288"] on a Zen 3 (32 KiB L1d, 512 KiB L2)
    tile_flags("avx512")  # on a Zen 4: ["-DKC=128", "-DX_BYTES=524288", "-DREGISTER_MAX_M=4"]

The constants in packed_linear.c were measured on an Intel Xeon (48 KiB L1d, 2 MiB L2); an Intel CPU, or one
whose vendor or caches cannot be read, gets them unchanged (no flags: the same object code). Another vendor's CPU
gets its blocking from its own caches, as those constants were derived: the dequantized scratch tile (KC x NR
floats) takes half the L1d, and a pass's rows of x (X_BYTES) at most the L2 (X_BYTES_MAX). On Zen 3 and Zen 4
(32 KiB L1d, 512 KiB / 1 MiB L2) that gives the constants' values: the blocking is not where those CPUs lose to
the Xeon (Zen 3: ~78% of one core's fma peak at 64-1024 rows either way; Zen 4 issues a 512-bit fma as two
256-bit halves, half the Xeon's fma rate per cycle); a CPU with smaller caches gets smaller blocks. With AVX-512 such a
CPU also runs batches of 3 and 4 rows on the register path (REGISTER_MAX_M=4) instead of the scratch tile: on a Zen 4,
a forward's matmuls at 3 rows took 11-14 instead of 19 ms (Q4_1) and 14-15 instead of 30 (bf16), at 4 rows 15-19
instead of 21-24 and 15-16 instead of 29-31; on the Xeon the tile won from 3 rows (10.3 vs 12.4 ms).
STEPLOOP_CPU_TUNING picks the rule:
"vendor" (default, as above), "constants" (the Xeon's on any CPU: benchmarks time one against the other in one
run) or "caches" (the rule of a CPU not Intel's, on any CPU, Intel's included: blocks from the caches, 3 and 4 rows
in registers with AVX-512; tests build it to check its bits).
The blocking never changes a result: each output stays one fma chain over k in order (packed_linear.c).
"""

from __future__ import annotations

import os
import pathlib

from steploop.common import envs

RULES = ("vendor", "constants", "caches")
CACHE_ROOT = pathlib.Path("/sys/devices/system/cpu/cpu0/cache")
QK = 32                       # the kernel's k chunks are whole quantization blocks
# x per pass: no more than the L2, and no more than 512 KiB, more measured no faster on either vendor (Xeon, 2 MiB
# L2: 1 MiB 202 vs 214 GFLOP/s at 1024 rows; Zen 3, 512 KiB L2: 256 KiB, 512 KiB and 1 MiB within 3% at 256 and
# 1024 rows, one thread)
X_BYTES_MAX = 1 << 19
VECTOR_FLOATS = {"avx512": 16, "avx2": 8, "generic": 4}    # VL of each build (vector_width.h)


def vendor(cpuinfo: str | None = None) -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD, ...), or "" when there is none (not x86)."""
    if cpuinfo is None:
        try:
            cpuinfo = pathlib.Path("/proc/cpuinfo").read_text()
        except OSError:
            return ""
    return next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("vendor_id")), "")


def _size(text: str) -> int | None:
    """sysfs cache size ("32K", "1024K", "32M") in bytes."""
    text = text.strip()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale > 1 else text
    return int(digits) * scale if digits.isdigit() else None


def cache_sizes(root: pathlib.Path = CACHE_ROOT) -> dict[str, int]:
    """{"L1d": bytes, "L2": bytes} of cpu0's caches as sysfs lists them (a size it cannot read is left out)."""
    out = {}
    for index in sorted(root.glob("index*")):
        try:
            level, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
        except OSError:
            continue
        name = "L1d" if (level, kind) == ("1", "Data") else "L2" if level == "2" else None
        if name and _size(size):
            out[name] = _size(size)
    return out


def rule(environ=os.environ) -> str:
    """STEPLOOP_CPU_TUNING, checked (default "vendor")."""
    value = environ.get(envs.CPU_TUNING, "").strip().lower() or "vendor"
    if value not in RULES:
        raise ValueError(f"{envs.CPU_TUNING}={value!r}: one of {', '.join(RULES)}")
    return value


def tile_flags(isa: str, cpu_vendor: str | None = None, caches: dict[str, int] | None = None,
               environ=os.environ) -> list[str]:
    """gcc flags setting packed_linear.c's KC and X_BYTES for this CPU ([]: the constants). The arguments stand
    in for what is read from the system (tests)."""
    how = rule(environ)
    if how == "constants" or (how == "vendor" and (cpu_vendor if cpu_vendor is not None else vendor())
                               in ("GenuineIntel", "")):
        return []
    # 3 and 4 rows in registers (no scratch tile) where there are 32 vector registers for their accumulators
    rows = ["-DREGISTER_MAX_M=4"] if isa == "avx512" else []
    caches = cache_sizes() if caches is None else caches
    if "L1d" not in caches or "L2" not in caches:
        return rows
    nr = 2 * VECTOR_FLOATS[isa]                                   # the tile's width: two vectors of output rows
    kc = max(QK, caches["L1d"] // 2 // (4 * nr) // QK * QK)
    return [f"-DKC={kc}", f"-DX_BYTES={min(caches['L2'], X_BYTES_MAX)}"] + rows
