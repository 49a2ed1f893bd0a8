"""deploy/k8s on a real cluster: every namespaced object that any kustomization renders (overlays, components,
examples, base) lands in namespace `steploop`, where Secret steploop-tls, the pods and the NetworkPolicies are
(an object without one goes to the kubectl context's namespace, usually `default`); and an operator's overlay
that sets a registry with kustomize's images transformer (examples/registry, the README's way) leaves no image
on the bare `steploop/...` name, for every overlay and example it could sit on."""

from __future__ import annotations

import os
import pathlib

import pytest
import yaml

from tests.deploy.k8s_render import K8S, kustomizations, render

NAMESPACE = "steploop"
# The kinds the manifests use that are not namespaced (anything else is: a new cluster-scoped kind goes here).
CLUSTER_SCOPED = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "PriorityClass",
                  "StorageClass", "RuntimeClass", "IngressClass", "GatewayClass"}
EVERY_FOLDER = kustomizations(("Kustomization", "Component"))
REGISTRY_EXAMPLE = K8S / "examples" / "registry"


def rel(folder: pathlib.Path) -> str:
    return str(folder.relative_to(K8S))


def test_components_are_rendered_too():
    names = {rel(f) for f in EVERY_FOLDER}
    assert {"components/hpa", "components/keda", "components/monitoring", "overlays/tp",
            "examples/inference-extension", "examples/registry"} <= names, names


@pytest.mark.parametrize("folder", EVERY_FOLDER, ids=rel)
def test_every_namespaced_object_is_in_steploop(folder):
    docs = render(folder)
    assert docs, rel(folder)
    wrong = [f"{d['kind']}/{d['metadata']['name']}: {d['metadata'].get('namespace')!r}" for d in docs
             if d["kind"] not in CLUSTER_SCOPED and d["metadata"].get("namespace") != NAMESPACE]
    assert not wrong, f"{rel(folder)}: objects outside namespace {NAMESPACE}:\n" + "\n".join(wrong)
    for ns in (d for d in docs if d["kind"] == "Namespace"):
        assert ns["metadata"]["name"] == NAMESPACE


def images_of(doc: dict) -> list[str]:
    """Every container image in an object, wherever its pod template sits (custom resources included)."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("containers", "initContainers") and isinstance(value, list):
                    found.extend(c["image"] for c in value if isinstance(c, dict) and "image" in c)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)
    walk(doc)
    return found


def registry_images() -> list[dict]:
    return yaml.safe_load((REGISTRY_EXAMPLE / "kustomization.yaml").read_text())["images"]


def test_the_registry_example_renames_every_image():
    registry = {entry["newName"].rsplit("/", 1)[0] for entry in registry_images()}
    assert len(registry) == 1, registry
    (registry,) = registry
    images = [image for doc in render(REGISTRY_EXAMPLE) for image in images_of(doc)]
    assert images and all(image.startswith(registry + "/") and image.endswith(":0.1.0") for image in images), images


@pytest.mark.parametrize("target", [f for f in kustomizations() if f not in (K8S / "base", REGISTRY_EXAMPLE)],
                         ids=rel)
def test_a_registry_overlay_leaves_no_bare_image(tmp_path, target):
    """The registry example's `images:` over each overlay and example: every image is the registry's."""
    overlay = tmp_path / "my-steploop"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(target, overlay)], "images": registry_images()}))
    images = [image for doc in render(overlay) for image in images_of(doc)]
    bare = sorted({image for image in images if image.startswith("steploop/") or "/" not in image})
    assert images and not bare, f"{rel(target)} under a registry overlay still pulls {bare}"
