"""Helpers for the Kubernetes tests: `kubectl kustomize` exactly as docs/deploy.md tells users to
run it, offline schema validation, and lookups into the built manifests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from tests.deploy.crd_schemas import CRD_SCHEMAS

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
# The documented build command (docs/deploy.md quotes it; a test checks).
KUSTOMIZE_ARGS = ["kustomize", "--load-restrictor", "LoadRestrictionsNone"]
KUBECTL_HINT = (
    "kubectl (with kustomize v5) not found: the tests build the manifests with "
    "`kubectl kustomize`. Install kubectl 1.27 or newer (this project's machines ship it at "
    "/usr/bin/kubectl; Debian's kubernetes-client package is too old)."
)
# Kubernetes minor version the built-in kinds are validated against.
K8S_VERSION = "1.30.0"

Manifest = dict[str, Any]


def kubectl() -> str:
    binary = shutil.which("kubectl")
    assert binary is not None, KUBECTL_HINT
    return binary


def build(path: Path) -> list[Manifest]:
    result = subprocess.run(
        [kubectl(), *KUSTOMIZE_ARGS, str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"kubectl kustomize {path} failed:\n{result.stderr}"
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def validate(doc: Manifest) -> None:
    """Built-in kinds against Kubernetes' OpenAPI schemas (strict: unknown fields fail), CRDs
    against the structural schemas in crd_schemas.py."""
    kind, api = doc.get("kind"), doc.get("apiVersion")
    name = f"{kind} {doc.get('metadata', {}).get('name')}"
    if (api, kind) in CRD_SCHEMAS:
        try:
            jsonschema.validate(doc, CRD_SCHEMAS[api, kind])
        except jsonschema.ValidationError as e:
            raise AssertionError(f"{name}: {e.message} at {list(e.absolute_path)}") from None
        return
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise AssertionError(f"{name}: {e.message} at {list(e.path)}") from None
    except kubernetes_validate.SchemaNotFoundError:
        raise AssertionError(f"{name}: no schema for {api} {kind}") from None


def find(docs: list[Manifest], kind: str, name: str) -> Manifest:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def container(doc: Manifest, name: str) -> Manifest:
    (found,) = [c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def env(c: Manifest) -> dict[str, Any]:
    """name -> value (a string) or valueFrom (a dict)."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def pre_stop_seconds(c: Manifest) -> float:
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return float(command[1])


def selects(selector: Manifest, labels: dict[str, str]) -> bool:
    return selector.get("matchLabels", {}).items() <= labels.items()


def pod_labels(doc: Manifest) -> dict[str, str]:
    return doc["spec"]["template"]["metadata"]["labels"]
