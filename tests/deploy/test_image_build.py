"""How `make images` builds (no Docker engine needed to check): on the host's network with the classic builder,
no `# syntax=` line (Docker would fetch a frontend image), each build's context the sources .dockerignore lets
through, and the torch wheels only in the contexts of the builds that install torch."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.deploy.k8s_render import ROOT

DOCKERFILE = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()


def make_n(target: str) -> str:
    out = subprocess.run(["make", "-s", "-n", target, "CA_BUNDLE=ca.pem"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True)
    return out.stdout.replace("\\\n", " ")


def test_the_dockerfile_needs_no_frontend_image_and_cites_what_exists():
    assert not re.search(r"^#\s*syntax\s*=", DOCKERFILE, re.M | re.I)
    for path in re.findall(r"\b(deploy/[\w./-]+\.\w+)", DOCKERFILE):
        assert (ROOT / path).exists(), f"the Dockerfile cites {path}, which does not exist"


@pytest.mark.parametrize("image", ["scheduler", "worker-cpu", "model", "gateway"])
def test_builds_use_the_host_network_and_a_narrow_context(image):
    command = make_n(f"image-{image}")
    tar, _, build = command.partition("|")
    assert "--network host" in build and build.rstrip().endswith(" -"), command
    sent = tar.split()
    if image == "scheduler":   # no torch in its stages: the wheels folder's README and the CA bundle only
        assert "deploy/wheels" not in sent and {"deploy/wheels/README.md", "deploy/wheels/ca.pem"} <= set(sent)
    else:
        assert "deploy/wheels" in sent
    allowed = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    for path in (p for p in sent if not p.startswith("-") and p != "tar"):
        assert path in allowed or path.startswith("deploy/wheels"), f"{path} is not in .dockerignore's list"
    assert allowed - {"deploy/wheels"} <= set(sent), allowed - set(sent)
