"""The project installs the way a user's pip and the container images install it: sdist and wheel built from a
clean copy of the checkout (no generated stubs in it, so the build hook in setup.py must make them), the wheel
installed into a fresh venv outside the checkout, and every command's --help run from there.

The fresh venv gets the wheel alone (--no-deps); its dependencies come from this test run's own environment
through a .pth line (a plain path: the editable install's finder in that folder is not activated), so the test
needs no index and takes seconds. The imports are checked to come from the fresh venv, not the checkout.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from steploop.cli import COMMANDS

ROOT = pathlib.Path(__file__).resolve().parents[2]
# In the sdist the repository's layout (services/...); in the wheel the import package (steploop/...).
STUBS = ["common/pb/steploop/v1/engine_pb2.py", "common/pb/steploop/v1/engine_pb2_grpc.py",
         "common/pb/steploop/v1/worker_pb2.py", "common/pb/steploop/v1/worker_pb2_grpc.py"]

pytestmark = pytest.mark.slow


def clean_copy(dest: pathlib.Path) -> pathlib.Path:
    """The checkout's tracked and untracked-but-not-ignored files: what a fresh clone (or `COPY . .`) holds."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    assert not (dest / "services/common/pb").exists(), "generated stubs leaked into the clean copy"
    return dest


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> pathlib.Path:
    src = clean_copy(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("dist")
    # No --sdist/--wheel: build makes the sdist, then the wheel from that sdist (what pip does with an sdist).
    build = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
                           capture_output=True, text=True, timeout=300, check=False)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    assert "deprecat" not in (build.stdout + build.stderr).lower(), "setuptools warns about the project metadata"
    return out


def test_sdist_and_wheel_carry_the_generated_stubs(dist):
    import tarfile

    (wheel,), (sdist,) = dist.glob("*.whl"), dist.glob("*.tar.gz")
    wheel_names = set(zipfile.ZipFile(wheel).namelist())
    with tarfile.open(sdist) as tar:
        sdist_names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for stub in STUBS:
        assert f"steploop/{stub}" in wheel_names, f"steploop/{stub} missing from the wheel"
        assert f"services/{stub}" in sdist_names, f"services/{stub} missing from the sdist"
    assert any(n.endswith("licenses/LICENSE") for n in wheel_names)
    for source in ("gpu_worker/cpu_kernels/paged_attention.c", "gpu_worker/cpu_kernels/vector_width.h",
                   "scheduler/fastpath/decode_loop.c"):       # compiled at run time, so they ship
        assert f"steploop/{source}" in wheel_names and f"services/{source}" in sdist_names, source
    # The wheel claims one top-level name of its own: a user's `services` or `tests` package is theirs.
    top = {n.split("/", 1)[0] for n in wheel_names if not n.startswith("steploop-")}
    assert top == {"steploop"}, top


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> pathlib.Path:
    home = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(home)], check=True, timeout=120)
    py = home / "bin" / "python"
    (wheel,) = dist.glob("*.whl")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   timeout=120, cwd=home)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (pathlib.Path(site) / "zz_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    return home


def run_in(venv: pathlib.Path, *argv: str) -> subprocess.CompletedProcess:
    # cwd is the venv (outside the checkout): nothing is importable from the working directory.
    return subprocess.run(argv, check=False, cwd=venv, capture_output=True, text=True, timeout=120,
                          env={"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(pathlib.Path.home())})


def test_installed_package_imports_from_the_venv(venv):
    out = run_in(venv, str(venv / "bin" / "python"), "-c",
                 "import steploop, steploop.common.pb.steploop.v1.engine_pb2 as pb; print(steploop.__file__); "
                 "print(pb.__file__)")
    assert out.returncode == 0, out.stderr
    for line in out.stdout.split():
        assert line.startswith(str(venv)), f"imported from outside the fresh venv: {line}"


def test_scheduler_c_loops_build_from_the_installed_wheel(venv, tmp_path):
    """The installed package compiles its scheduler loops (gcc is on CI's PATH); without gcc it would say so and
    run the Python loops."""
    import shutil

    code = "from steploop.scheduler import fastpath; m = fastpath.load(); print(m is not None, fastpath.SOURCE)"
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], check=False, cwd=venv, capture_output=True,
                         text=True, timeout=120, env={"PATH": f"{venv / 'bin'}:/usr/bin:/bin",
                                                      "HOME": str(pathlib.Path.home()),
                                                      "STEPLOOP_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    built, source = out.stdout.split()
    assert source.startswith(str(venv))
    assert built == str(shutil.which("gcc", path="/usr/bin:/bin") is not None), out.stderr[-2000:]


def test_steploop_help_from_the_installed_wheel(venv):
    out = run_in(venv, str(venv / "bin" / "steploop"), "--help")
    services = ("serve", "gateway", "scheduler", "worker")
    assert out.returncode == 0 and all(f"steploop {c}" in out.stdout for c in services), out.stdout + out.stderr


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_service_help_from_the_installed_wheel(venv, command):
    out = run_in(venv, str(venv / "bin" / "steploop"), command, "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage: steploop") or f"steploop {command} " in out.stdout, out.stdout[:500]


def test_installs_beside_a_users_own_services_package(venv, tmp_path):
    """An application with its own top-level `services` package (a common name) imports it and steploop's client
    side by side: steploop claims only the name `steploop`."""
    app = tmp_path / "app"
    (app / "services").mkdir(parents=True)
    (app / "services" / "__init__.py").write_text("OWNER = 'the application'\n")
    (app / "services" / "billing.py").write_text("def charge():\n    return 'charged'\n")
    code = ("import services, services.billing\n"
            "from steploop.client import EngineClient, EngineRequest, SamplingParams\n"
            "import steploop.gateway.app, steploop.scheduler.scheduler\n"
            "assert services.OWNER == 'the application' and services.billing.charge() == 'charged'\n"
            "print(services.__file__); print(EngineClient.__module__)\n")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], check=False, cwd=app, capture_output=True,
                         text=True, timeout=120, env={"PATH": f"{venv / 'bin'}:/usr/bin:/bin",
                                                      "HOME": str(pathlib.Path.home())})
    assert out.returncode == 0, out.stderr[-3000:]
    users, client_module = out.stdout.split()
    assert users == str(app / "services" / "__init__.py")
    assert client_module.startswith("steploop.")
