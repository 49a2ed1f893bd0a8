"""A policy scan of the rendered manifests (checkov, kubernetes framework): every finding is fixed or waived
with its reason in deploy/k8s/policy-waivers.yaml. checkov lives in its own venv (`make policy-tools`, also a
prerequisite of `make test`): its pinned dependencies would fight the project's."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess

import pytest
import yaml

from tests.deploy.k8s_render import K8S, ROOT, kustomizations, render_text

pytestmark = pytest.mark.slow
WAIVERS = yaml.safe_load((K8S / "policy-waivers.yaml").read_text())


def checkov() -> str:
    for candidate in (os.environ.get("CHECKOV"), str(ROOT / ".venv-policy" / "bin" / "checkov"),
                      shutil.which("checkov")):
        if candidate and pathlib.Path(candidate).is_file():
            return candidate
    raise RuntimeError("checkov not found: run `make policy-tools` (a venv in .venv-policy), or set CHECKOV")


def test_every_waiver_has_a_reason():
    assert WAIVERS and all(isinstance(r, str) and len(r.split()) >= 8 for r in WAIVERS.values()), WAIVERS


def test_checkov_finds_nothing_unwaived(tmp_path):
    for folder in kustomizations():
        (tmp_path / (str(folder.relative_to(K8S)).replace("/", "_") + ".yaml")).write_text(render_text(folder))
    out = subprocess.run([checkov(), "-d", str(tmp_path), "--framework", "kubernetes", "--compact", "--skip-download",
                          "--output", "json", "--skip-check", ",".join(WAIVERS)], capture_output=True, text=True,
                         timeout=600, check=False)
    reports = json.loads(out.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = [f"{c['check_id']} {c['check_name']} ({c['resource']} in {pathlib.Path(c['file_path']).name})"
              for r in reports for c in r.get("results", {}).get("failed_checks", [])]
    passed = sum(len(r.get("results", {}).get("passed_checks", [])) for r in reports)
    assert not failed, "checkov findings (fix them, or waive with a reason in policy-waivers.yaml):\n" + \
        "\n".join(failed)
    assert passed > 100, f"checkov passed only {passed} checks: did it scan the manifests? {out.stderr[-2000:]}"
