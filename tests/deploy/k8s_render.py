"""Renders deploy/k8s with kubectl's built-in kustomize (offline) and finds the kustomizations to render."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"


def kustomizations(kinds: tuple[str, ...] = ("Kustomization",)) -> list[pathlib.Path]:
    """Every folder holding a kustomization of one of `kinds` (by default Kustomizations: components are rendered
    through the overlays that use them; ("Kustomization", "Component") gives every folder `kubectl kustomize`
    renders)."""
    found = []
    for path in sorted(K8S.rglob("kustomization.yaml")):
        if yaml.safe_load(path.read_text()).get("kind", "Kustomization") in kinds:
            found.append(path.parent)
    return found


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        raise RuntimeError("kubectl is needed to render deploy/k8s (its built-in kustomize works offline): install "
                           "Debian's or Kubernetes' kubectl package, or a kustomize binary as kubectl")
    return path


def render(folder: pathlib.Path) -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=120,
                         check=False)
    if out.returncode != 0:
        raise AssertionError(f"kubectl kustomize {folder.relative_to(ROOT)} failed:\n{out.stderr}")
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def render_text(folder: pathlib.Path) -> str:
    return yaml.safe_dump_all(render(folder), sort_keys=False)
