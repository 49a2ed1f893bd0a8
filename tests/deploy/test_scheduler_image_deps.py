"""The scheduler image leaves out the gateway's tokenizer stack (deploy/docker/requirements.py): nothing the
scheduler runs may import it. Checked twice: no import of those packages anywhere in services/scheduler or
services/common (a lazy import inside a function counts), and the scheduler's entry points import with them
blocked, as in the image."""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import subprocess
import sys

from tests.deploy.k8s_render import ROOT

spec = importlib.util.spec_from_file_location("image_requirements", ROOT / "deploy" / "docker" / "requirements.py")
image_requirements = importlib.util.module_from_spec(spec)
spec.loader.exec_module(image_requirements)
LEFT_OUT = image_requirements.SCHEDULER_LEAVES_OUT
SCHEDULER_CODE = ("services/scheduler", "services/common")
BLOCKED_IMPORT = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {left_out!r}:
            raise ImportError(f"{{name}} is not in the scheduler image")
sys.meta_path.insert(0, Block())
import steploop.cli, steploop.scheduler.server, steploop.scheduler.fastpath
"""


def imported_names(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_scheduler_code_imports_none_of_the_left_out_packages():
    found = {str(path.relative_to(ROOT)): sorted(imported_names(path) & LEFT_OUT)
             for folder in SCHEDULER_CODE for path in sorted((ROOT / folder).rglob("*.py"))
             if "/pb/" not in str(path)}
    assert not {k: v for k, v in found.items() if v}, "the scheduler image has no " + ", ".join(sorted(LEFT_OUT))


def test_scheduler_entry_points_import_without_them():
    out = subprocess.run([sys.executable, "-c", BLOCKED_IMPORT.format(left_out=set(LEFT_OUT))], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_image_requirements_keep_the_rest():
    names = {image_requirements.name_of(r) for r in image_requirements.requirements(LEFT_OUT)}
    assert {"grpcio", "grpcio-health-checking", "protobuf", "prometheus-client"} <= names, names
    assert not names & LEFT_OUT
