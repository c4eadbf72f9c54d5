"""Offline validation of the deployment files (no Docker engine or cluster runs here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from spade.cli import serve

ROOT = Path(__file__).resolve().parents[2]
SERVICES = set(serve.list_commands(None))  # type: ignore[arg-type]


def _k8s_docs() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((ROOT / "k8s" / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((ROOT / "k8s" / name).read_text()) if d]
    return docs


def test_every_kustomize_resource_exists_and_parses() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in _k8s_docs()}
    for workload in ("sandbox", "memory", "designer", "rollout"):
        assert ("Deployment", workload) in kinds
    assert ("StatefulSet", "learner") in kinds


def test_workloads_run_known_services_with_resources_and_matching_ports() -> None:
    docs = _k8s_docs()
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = doc["spec"]
        assert spec["selector"]["matchLabels"] == spec["template"]["metadata"]["labels"]
        for container in spec["template"]["spec"]["containers"]:
            assert container["resources"]["limits"], doc["metadata"]["name"]
            if container["image"] == "spade":
                argv = container.get("args") or container["command"]
                name = argv[argv.index("serve") + 1]
                assert name in SERVICES, f"{doc['metadata']['name']} runs unknown service {name!r}"
            named_ports = {p["name"] for p in container.get("ports", [])}
            svc = services.get(doc["metadata"]["name"])
            if svc is not None:
                assert {p["targetPort"] for p in svc["spec"]["ports"]} <= named_ports


def test_compose_services_run_known_commands() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        command = service.get("command")
        if service.get("image", "").startswith("spade"):
            assert command[0] == "serve" and command[1] in SERVICES, name


def _settings_fields() -> dict[str, set[str]]:
    from services.designer.settings import DesignerSettings
    from services.inference.settings import InferenceSettings
    from services.learner.settings import LearnerSettings
    from services.memory.settings import MemorySettings
    from services.rollout.settings import RolloutSettings
    from services.sandbox.settings import SandboxSettings

    classes: dict[str, Any] = {
        "SANDBOX": SandboxSettings,
        "MEMORY": MemorySettings,
        "DESIGNER": DesignerSettings,
        "ROLLOUT": RolloutSettings,
        "LEARNER": LearnerSettings,
        "INFERENCE": InferenceSettings,
    }
    return {prefix: set(cls.model_fields) for prefix, cls in classes.items()}


def _env_names() -> set[str]:
    names: set[str] = set()
    for doc in _k8s_docs():
        if doc["kind"] == "ConfigMap":
            names |= set(doc["data"])
        for container in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            names |= {e["name"] for e in container.get("env", [])}
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for service in compose["services"].values():
        names |= set(service.get("environment") or {})
    return names


def test_every_spade_variable_names_a_real_setting() -> None:
    fields = _settings_fields()
    for name in sorted(n for n in _env_names() if n.startswith("SPADE_")):
        service, _, rest = name.removeprefix("SPADE_").partition("_")
        assert service in fields, f"{name}: no service {service}"
        field = rest.split("__")[0].lower()
        assert field in fields[service], f"{name}: {service} settings have no field {field!r}"
