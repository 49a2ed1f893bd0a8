"""The build hook: generate the protobuf/gRPC stubs (services/common/pb/) before setuptools collects packages.

Why a hook and not committed stubs: the stubs are build output of protos/ (never edited, git-ignored), and a
committed copy drifts from the .proto files the moment someone forgets to regenerate. Every build path runs this
file first (`pip install .`, `pip wheel`, `python -m build` for the sdist and the wheel), so each sdist and wheel
carries stubs made from the protos it ships. Generation runs here, at module level, because setuptools lists
the packages (PACKAGES below) before any build command runs: a command-level hook would be too
late to add steploop.common.pb to the wheel. An sdist already holds the stubs, so building a wheel from it needs
no grpcio-tools; from a checkout it does (a build requirement, also in the `dev` extra).
"""

import pathlib
import runpy

from setuptools import find_packages, setup

ROOT = pathlib.Path(__file__).resolve().parent
STUBS = ROOT / "services" / "common" / "pb"


def generate_stubs() -> None:
    protos = sorted((ROOT / "protos").rglob("*.proto"))
    if not protos:                                    # nothing to generate from (should not happen in a checkout)
        return
    newest_proto = max(p.stat().st_mtime for p in protos)
    stubs = list(STUBS.rglob("*_pb2*.py")) if STUBS.is_dir() else []
    if stubs and min(s.stat().st_mtime for s in stubs) >= newest_proto:
        return                                        # an sdist, or a checkout built since the last proto edit
    try:
        import grpc_tools  # noqa: F401
    except ImportError as exc:
        raise SystemExit("building steploop from a checkout needs grpcio-tools (it generates services/common/pb "
                         "from protos/): pip install grpcio-tools==1.76.0, or build with build isolation") from exc
    gen = runpy.run_path(str(ROOT / "scripts" / "gen_protos.py"))
    if gen["main"]() != 0:
        raise SystemExit("protobuf stub generation failed (scripts/gen_protos.py)")


generate_stubs()
# The repository keeps its layout (services/gateway, services/scheduler, services/gpu_worker); installed, the code
# is the import package `steploop` (nothing else at the top level), so a user's own `services` package is left alone.
PACKAGES = ["steploop" + name[len("services"):] for name in find_packages(include=["services", "services.*"])]
setup(package_dir={"steploop": "services"}, packages=PACKAGES)
