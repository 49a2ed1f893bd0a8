"""Gateway and scheduler never import torch or triton (they run on machines without them)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import sys
import {module}
bad = sorted(m for m in ("torch", "triton") if m in sys.modules)
print(",".join(bad))
"""


@pytest.mark.parametrize("module", ["steploop.gateway.server", "steploop.scheduler.server",
                                    "steploop.scheduler.scheduler", "steploop.serve", "steploop.cli"])
def test_no_torch_or_triton(module):
    out = subprocess.run([sys.executable, "-c", CHECK.format(module=module)], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "", f"{module} imported {out.stdout.strip()}"
