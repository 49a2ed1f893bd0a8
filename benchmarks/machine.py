"""The machine a benchmark ran on (CPU model and SIMD flags, cores, memory, GPU, library versions, load), written
beside every result: shared by compare.py, cpu_peers.py and paged_attention.py, so neither imports the other."""

from __future__ import annotations

import datetime
import os
import pathlib
import platform
import subprocess


def git_commit() -> str | None:
    """The checkout's commit (short), '+dirty' when tracked files differ from it: every table names the code it
    measured. None outside a git checkout (an installed package)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def machine_info() -> dict:
    import importlib.metadata

    import torch
    lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines() if os.path.exists("/proc/cpuinfo") else []
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
               platform.processor())
    flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
    mem = next((int(line.split()[1]) for line in (pathlib.Path("/proc/meminfo").read_text().splitlines()
                                                   if os.path.exists("/proc/meminfo") else [])
                if line.startswith("MemTotal")), 0)

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "simd": [f for f in ("avx2", "fma", "avx512f", "avx512_bf16",
                                                                         "amx_tile") if f in flags],
            "memory_gib": round(mem / 2**20, 1), "os": f"{platform.system()} {platform.release()}",
            "gpu": gpu, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "transformers": version("transformers"), "llama_cpp_python": version("llama_cpp_python"),
            "python": platform.python_version(), "commit": git_commit(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "load_average_at_start": os.getloadavg()}
