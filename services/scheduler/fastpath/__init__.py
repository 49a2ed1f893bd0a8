"""The scheduler's plain-decode loops in C (decode_loop.c), compiled with gcc on first use and cached.

    loops = fastpath.load()      # the extension module, or None: then every request takes the Python path

Why C: at 1024 running decodes the Python path costs several us per request per step, most of it bytecode
dispatch over a dozen field reads and calls; issue 23 asks for <= 1 us (a GPU step every ~10 ms must not wait on
the scheduler). The C functions do for a plain decode only what the Python path does (running_pass.py,
step_update.py), and hand every other request back to it, so behaviour is the same either way
(tests/scheduler/test_fast_paths.py runs both on the same workloads and compares every plan and output).

The library is keyed by the source and the Python build; a temp file is renamed into place so several processes
may build at once. No gcc, no Python headers, a failed compile, or STEPLOOP_SCHEDULER_C_LOOPS=0:
one log line and None.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from types import ModuleType

from steploop.common import envs
from steploop.common.model_path import cache_dir

log = logging.getLogger(__name__)

NAME = "steploop_decode_loop"             # the module name PyInit_ is compiled for
SOURCE = pathlib.Path(__file__).with_name("decode_loop.c")


def library_path() -> pathlib.Path:
    # Keyed by the source and the Python build only: it is plain C with no -march, so any gcc's output works, and
    # an image may carry one built in its build stage and no gcc (deploy/docker/Dockerfile, the scheduler).
    key = f"{SOURCE.read_text()}\0{sys.version}\0{sysconfig.get_platform()}"
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return cache_dir() / "scheduler" / f"{NAME}-{hashlib.sha256(key.encode()).hexdigest()[:16]}{suffix}"


def build() -> pathlib.Path | None:
    """The compiled extension, compiling it if it is not cached; None when it cannot be built."""
    path = library_path()
    if path.is_file():
        return path
    gcc = shutil.which(os.environ.get("CC", "gcc"))
    try:
        if gcc is None:
            raise RuntimeError("gcc not found")
        include = sysconfig.get_paths()["include"]
        if not (pathlib.Path(include) / "Python.h").is_file():
            raise RuntimeError(f"no Python.h in {include}")
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = pathlib.Path(tmp) / path.name
            done = subprocess.run([gcc, "-O2", "-shared", "-fPIC", "-fno-strict-aliasing", f"-I{include}",
                                   "-o", str(out), str(SOURCE)], check=False, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"gcc failed: {done.stderr.strip()[-500:]}")
            os.chmod(out, 0o755)
            os.replace(out, path)
        return path
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("scheduler C loops not built (%s); the scheduler runs its Python path", exc)
        return None


@functools.cache
def load() -> ModuleType | None:
    """The initialised extension module, or None (switched off, or it cannot be built or initialised)."""
    if envs.switched_off(envs.SCHEDULER_C_LOOPS):
        return None
    path = build()
    if path is None:
        return None
    from steploop.scheduler.request import Request, RequestOutput, RequestStatus

    try:
        loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
        spec = importlib.util.spec_from_file_location(NAME, str(path), loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        module.init(Request, RequestOutput, RequestStatus.RUNNING)
    except (ImportError, OSError, TypeError, AttributeError) as exc:
        log.warning("scheduler C loops not loaded (%s); the scheduler runs its Python path", exc)
        return None
    log.info("scheduler plain-decode loops in C: %s", path)
    return module
