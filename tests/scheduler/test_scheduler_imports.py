"""The scheduler core is transport-free: it imports neither grpc, torch nor asyncio."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CORE = ["config", "request", "block_pool", "kv_cache_manager", "scheduler", "async_scheduler", "policy",
        "prefix_cache", "ngram_proposer", "handles", "request_outputs", "integrity", "stats"]

CHECK = f"""
import sys
from pathlib import Path
for name in {CORE!r}:
    __import__("steploop.scheduler." + name)
print(",".join(sorted(m for m in sys.modules if m.split(".")[0] in ("grpc", "torch", "triton", "asyncio"))))
"""


def test_core_imports_no_transport_and_no_torch():
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "", f"scheduler core imported {out.stdout.strip()}"
