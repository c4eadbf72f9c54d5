"""The deployment files as data: kustomize overlays rendered offline, compose with its variables.

Rendering uses ``kubectl kustomize`` (kubectl is installed on the project's machines; nothing here
talks to a cluster). Validation uses strict schemas: Kubernetes' own from the pinned
``kubernetes-validate`` package, KEDA's CRDs vendored in ``deploy/schemas/keda``.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[3]
OVERLAYS = ("dev", "gpu")
#: The Kubernetes version the manifests target (user namespaces and procMount on by default).
KUBERNETES_VERSION = "1.33.0"
KEDA_CRDS = ROOT / "deploy" / "schemas" / "keda"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job", "DaemonSet")


@functools.cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    """Every resource of ``k8s/overlays/<overlay>`` as ``kubectl kustomize`` renders it."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render the kustomize overlays (Debian's `kubectl` package)"
    out = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "k8s" / "overlays" / overlay)],
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, f"kustomize {overlay}: {out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The PodSpec of a workload (None for other kinds)."""
    if doc["kind"] in WORKLOAD_KINDS:
        return doc["spec"]["template"]["spec"]
    return None


def _strict(schema: Any) -> Any:
    """A CRD's openAPIV3Schema made strict, as kubeconform -strict does: unknown fields are errors."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> strict JSON schema, for every vendored CRD version."""
    schemas = {}
    for path in sorted(KEDA_CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schemas[(f"{group}/{version['name']}", kind)] = _strict(version["schema"]["openAPIV3Schema"])
    return schemas


def validate(doc: dict[str, Any]) -> None:
    """Validate one resource strictly against its schema (raises with the path of the first error)."""
    key = (doc["apiVersion"], doc["kind"])
    if key in crd_schemas():
        jsonschema.validate(doc, crd_schemas()[key])
        return
    import kubernetes_validate

    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (comments and blanks skipped), as kubectl --from-env-file and compose read them."""
    values = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value
    return values


_VAR = re.compile(r"\$\{(\w+)(?::?([-?])([^}]*))?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?error}`` substitution."""

    def sub(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if env.get(name):
            return env[name]
        if op == "?":
            raise KeyError(f"{name}: {arg}")
        return arg or ""

    return _VAR.sub(sub, text)


def _interpolate_values(value: Any, env: dict[str, str]) -> Any:
    if isinstance(value, str):
        return interpolate(value, env)
    if isinstance(value, dict):
        return {k: _interpolate_values(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate_values(v, env) for v in value]
    return value


def compose(env: dict[str, str]) -> dict[str, Any]:
    """docker-compose.yml with its variables taken from ``env`` (in values, as Compose does: after parsing)."""
    return _interpolate_values(yaml.safe_load((ROOT / "docker-compose.yml").read_text()), env)
