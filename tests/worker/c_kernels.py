"""The mark for tests of the CPU C kernels: skipped only where there is no C compiler at all. Where gcc is, the
library is built at collection with build(strict=True), so a kernel that does not compile fails the suite with
gcc's message instead of skipping (as tests/scheduler/test_fast_paths.py does for the scheduler's C loops)."""

from __future__ import annotations

import pytest

from steploop.gpu_worker.cpu_kernels import build


def needs_c_kernels(isas: list[str] | None = None) -> pytest.MarkDecorator:
    """A skip mark where no compiler is on PATH; elsewhere a no-op once every ISA in `isas` (default: the
    selected one) built, else KernelBuildError."""
    if build.compiler() is None:
        return pytest.mark.skip(reason="no C compiler ($CC or gcc) on PATH: the CPU kernels cannot build here")
    for isa in isas or [None]:
        build.build(isa, strict=True)
    return pytest.mark.skipif(False, reason="the C kernels built")
