"""Offline checks of the Kubernetes overlays: they render, validate strictly against bundled
schemas (KEDA's CRDs included), meet their namespace's Pod Security level, and keep the scaling,
disruption and network rules the design asks for. No cluster is reachable here: docs/deploy.md
says what only a real cluster can prove."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from spade.inference.protocol import SGLANG_VERSION
from tests.unit.deploy.manifests import OVERLAYS, pod_spec, render, validate
from tests.unit.deploy.pod_security import violations


@pytest.mark.slow
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_resource_validates_strictly(overlay: str) -> None:
    docs = render(overlay)
    assert len(docs) > 20
    for doc in docs:
        try:
            validate(doc)
        except Exception as exc:
            raise AssertionError(f"{overlay}: {doc['kind']}/{doc['metadata']['name']}: {exc}") from None


def test_strict_validation_rejects_an_unknown_field_and_a_wrong_type() -> None:
    deployment = copy.deepcopy(next(d for d in render("dev") if d["kind"] == "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {}
    with pytest.raises(Exception, match="securityContxt"):
        validate(deployment)
    scaled = copy.deepcopy(next(d for d in render("dev") if d["kind"] == "ScaledObject"))
    scaled["spec"]["minReplicaCount"] = "two"
    with pytest.raises(Exception, match="two"):
        validate(scaled)
    scaled = copy.deepcopy(next(d for d in render("dev") if d["kind"] == "ScaledObject"))
    scaled["spec"]["pollingInterval_typo"] = 5
    with pytest.raises(Exception, match="pollingInterval_typo"):
        validate(scaled)


def _levels(docs: tuple[dict[str, Any], ...]) -> dict[str, str]:
    return {
        d["metadata"]["name"]: d["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
        for d in docs
        if d["kind"] == "Namespace"
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_meets_its_namespace_pod_security_level(overlay: str) -> None:
    docs = render(overlay)
    levels = _levels(docs)
    assert levels == {"spade": "restricted", "spade-sandbox": "baseline"}
    for doc in docs:
        pod = pod_spec(doc)
        if pod is None:
            continue
        namespace = doc["metadata"]["namespace"]
        annotations = doc["spec"]["template"]["metadata"].get("annotations") or {}
        found = violations(pod, levels[namespace], annotations)
        assert not found, f"{overlay}: {doc['kind']}/{doc['metadata']['name']} breaks {levels[namespace]}: {found}"
        # Only the sandbox, whose jails need an unmasked /proc, is outside `restricted`.
        if doc["metadata"]["name"] != "sandbox":
            assert not violations(pod, "restricted", annotations), doc["metadata"]["name"]


def test_the_sandbox_runs_user_namespaced_without_added_privilege() -> None:
    sandbox = next(d for d in render("dev") if d["kind"] == "Deployment" and d["metadata"]["name"] == "sandbox")
    pod = pod_spec(sandbox)
    assert pod is not None
    assert pod["hostUsers"] is False
    container = pod["containers"][0]
    sc = container["securityContext"]
    assert sc["procMount"] == "Unmasked" and sc["allowPrivilegeEscalation"] is False
    assert "SYS_ADMIN" not in sc["capabilities"].get("add", [])
    assert pod["securityContext"]["seccompProfile"]["type"] == "Localhost"
    # It is baseline only thanks to the user namespace: without it, procMount breaks baseline too.
    without_userns = {**pod, "hostUsers": True}
    assert any("procMount" in v for v in violations(without_userns, "baseline"))
    assert any("procMount" in v for v in violations(pod, "restricted"))


def test_the_pod_security_checker_catches_what_the_issue_found() -> None:
    bad = {
        "securityContext": {"seccompProfile": {"type": "Unconfined"}},
        "containers": [{"name": "sandbox", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}],
    }
    found = violations(bad, "baseline", {"container.apparmor.security.beta.kubernetes.io/sandbox": "unconfined"})
    assert any("SYS_ADMIN" in f for f in found)
    assert any("Unconfined" in f for f in found)
    assert any("apparmor" in f for f in found)
    root = {"containers": [{"name": "x", "securityContext": {}}], "volumes": [{"name": "h", "hostPath": {}}]}
    found = violations(root, "restricted")
    for rule in ("allowPrivilegeEscalation", "drop must contain ALL", "runAsNonRoot", "seccompProfile", "hostPath"):
        assert any(rule in f for f in found), rule


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscaled_workloads_have_no_fixed_replicas_and_long_running_ones_a_pdb(overlay: str) -> None:
    docs = render(overlay)
    workloads = {
        (d["metadata"]["namespace"], d["metadata"]["name"]): d
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
    }
    scaled = set()
    for doc in docs:
        if doc["kind"] == "HorizontalPodAutoscaler":
            scaled.add((doc["metadata"]["namespace"], doc["spec"]["scaleTargetRef"]["name"]))
        if doc["kind"] == "ScaledObject":
            scaled.add((doc["metadata"]["namespace"], doc["spec"]["scaleTargetRef"]["name"]))
            trigger = doc["spec"]["triggers"][0]
            assert trigger["type"] == "redis-streams" and "lagCount" in trigger["metadata"]
    assert {name for _, name in scaled} == {"sandbox", "designer", "rollout"}
    for key in scaled:
        assert key in workloads, f"autoscaler targets missing workload {key}"
        assert "replicas" not in workloads[key]["spec"], f"{key}: a fixed replicas fights the autoscaler"
    budgets = {
        (d["metadata"]["namespace"], d["spec"]["selector"]["matchLabels"]["app"])
        for d in docs
        if d["kind"] == "PodDisruptionBudget"
    }
    for ns, name in (("spade", "memory"), ("spade", "inference"), ("spade-sandbox", "sandbox"), ("spade", "rollout")):
        assert (ns, name) in budgets, f"no PodDisruptionBudget for {ns}/{name}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_default_deny_everywhere_and_no_egress_at_all_from_the_sandbox(overlay: str) -> None:
    docs = render(overlay)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    for ns in ("spade", "spade-sandbox"):
        assert any(
            p["metadata"]["namespace"] == ns
            and p["spec"]["podSelector"] == {}
            and set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
            and not p["spec"].get("ingress")
            and not p["spec"].get("egress")
            for p in policies
        ), f"no default-deny policy in {ns}"
    for p in policies:
        if p["metadata"]["namespace"] == "spade-sandbox":
            assert not p["spec"].get("egress"), f"{p['metadata']['name']} lets sandbox pods reach out"


def test_gpu_overlay_runs_the_pinned_sglang_and_a_cuda_learner_with_fsdp() -> None:
    docs = render("gpu")
    inference = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "inference")
    container = inference["spec"]["template"]["spec"]["containers"][0]
    assert container["image"].endswith(f":v{SGLANG_VERSION}")
    assert "/weights/published/latest" in container["args"]
    learner = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "learner")
    pod = learner["spec"]["template"]["spec"]
    main = pod["containers"][0]
    assert main["command"][0] == "torchrun" and "spade-gpu" in main["image"]
    assert main["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert {"name": "SPADE_LEARNER_DEVICE", "value": "cuda"} in main["env"]
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod["volumes"]), "/dev/shm for NCCL"
    assert pod["tolerations"]


def test_dev_overlay_runs_the_cpu_learner_and_embedded_inference_from_latest() -> None:
    docs = render("dev")
    learner = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "learner")
    main = learner["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "SPADE_LEARNER_DEVICE", "value": "cpu"} in main["env"]
    assert "nvidia.com/gpu" not in main["resources"]["limits"]
    inference = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "inference")
    env = {e["name"]: e.get("value") for e in inference["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SPADE_INFERENCE_MODEL_PATH"] == "/weights/published/latest"
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {
        ("StatefulSet", "postgres"),
        ("StatefulSet", "redis"),
        ("Job", "migrate"),
        ("Job", "place-weights"),
    } <= kinds


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_select_pods_that_name_their_target_ports_and_run_known_commands(overlay: str) -> None:
    from spade.cli import main, serve

    commands = set(main.list_commands(None))  # type: ignore[arg-type]
    services = set(serve.list_commands(None))  # type: ignore[arg-type]
    docs = render(overlay)
    pods = {
        (d["metadata"]["namespace"], d["spec"]["template"]["metadata"]["labels"]["app"]): pod_spec(d)
        for d in docs
        if pod_spec(d)
    }
    for doc in docs:
        pod = pod_spec(doc)
        for container in (pod or {}).get("containers", []):
            argv = [*(container.get("command") or []), *(container.get("args") or [])]
            # Arguments of the image's entrypoint, `spade` (a `command` replaces the entrypoint).
            if container["image"].rsplit("/", 1)[-1].startswith("spade:") and "command" not in container:
                assert argv[0] in commands, f"{doc['metadata']['name']} runs unknown command {argv[0]!r}"
                if argv[0] == "serve":
                    assert argv[1] in services, f"{doc['metadata']['name']} runs unknown service {argv[1]!r}"
        if doc["kind"] != "Service" or doc["spec"].get("type") == "ExternalName":
            continue
        key = (doc["metadata"]["namespace"], doc["spec"]["selector"]["app"])
        assert key in pods, f"Service {key} selects no pod"
        named = {p["name"] for c in pods[key]["containers"] for p in c.get("ports") or []}  # type: ignore[index]
        for port in doc["spec"]["ports"]:
            if isinstance(port["targetPort"], str):
                assert port["targetPort"] in named, f"Service {key}: no container port named {port['targetPort']}"
