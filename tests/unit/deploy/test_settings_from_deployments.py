"""Each service's settings, built from what the deployment files give its container — the test
that would have caught every start failure of issue 12 (an unsafe bind, a missing model path, a
path that no volume provides).

For every container that runs ``spade`` (in both Kubernetes overlays and in docker-compose.yml),
the environment the container would get (ConfigMaps, the secret templates, literal values) and its
command-line flags build the service's real settings class, whose start-up safety checks run as
they do in ``spade serve``; then every absolute path a setting names must be inside the image or
under one of the container's mounts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from services.cluster.envfile import DEFAULT_ENV_FILES, read_env_files
from tests.unit.deploy.manifests import OVERLAYS, ROOT, compose, pod_spec, read_env_file, render

#: What the image itself provides (Dockerfile): the venv and project, the baked model and corpus,
#: Debian's interpreter and tools the sandbox uses.
IMAGE_PATHS = ("/app", "/opt/spade", "/usr")
SECRETS = {
    "spade-secrets": read_env_file(ROOT / "k8s" / "secrets.example.env"),
    "spade-sandbox-secrets": read_env_file(ROOT / "k8s" / "sandbox-secrets.example.env"),
}


def _settings_class(service: str) -> Any:
    if service == "sandbox":
        from services.sandbox.settings import SandboxSettings

        return SandboxSettings
    if service == "memory":
        from services.memory.settings import MemorySettings

        return MemorySettings
    if service == "designer":
        from services.designer.settings import DesignerSettings

        return DesignerSettings
    if service == "rollout":
        from services.rollout.settings import RolloutSettings

        return RolloutSettings
    if service == "learner":
        from services.learner.settings import LearnerSettings

        return LearnerSettings
    if service == "inference":
        from services.inference.settings import InferenceSettings

        return InferenceSettings
    raise AssertionError(f"no settings class for service {service!r}")


def _service_of(argv: list[str]) -> str | None:
    """`spade serve NAME ...` -> NAME; torchrun of the learner's module -> learner; else None."""
    if "serve" in argv:
        return argv[argv.index("serve") + 1]
    if "services.learner.cli" in argv:
        return "learner"
    return None


def _no_flags(argv: list[str], what: str) -> None:
    """Deployments configure services through the environment only: one source, checked here."""
    flags = [a for a in argv if a.startswith("--") and not a.startswith("--nproc") and a != "--standalone"]
    assert not flags, f"{what}: {flags} set on the command line; use the SPADE_* variable instead"


def _paths(value: Any, where: str = "") -> Iterator[tuple[str, Path]]:
    """Every absolute path inside a settings object (nested models and lists included)."""
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            yield from _paths(getattr(value, name), f"{where}.{name}" if where else name)
    elif isinstance(value, Path) and value.is_absolute():
        yield where, value
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _paths(item, f"{where}[{i}]")


def build_settings(service: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The service's settings from exactly ``env``, with its start-up checks run as ``spade serve`` does."""
    for name in list(os.environ):
        if name.startswith("SPADE_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cls = _settings_class(service)
    prefix = str(cls.model_config["env_prefix"])
    for name in env:
        if name.startswith(prefix):  # a stale or misspelt name would be ignored silently
            field = name.removeprefix(prefix).split("__")[0].lower()
            assert field in cls.model_fields, f"{name}: {cls.__name__} has no field {field!r}"
    settings = cls()  # unsafe values are refused here (ServiceSettings.unsafe_settings)
    for check in ("check_safe", "require_safe"):  # services whose checks are still separate calls
        if hasattr(settings, check):
            getattr(settings, check)()
    queue = getattr(settings, "queue", None)
    if queue is not None:
        assert queue.kind == "redis", f"{service}: a standalone service needs the Redis queue, not {queue.kind}"
    return settings


#: The gRPC servers a service's settings may name, by field: the server's tenants variable.
SERVER_TENANTS = {"sandbox": "SPADE_SANDBOX_API_KEYS", "memory": "SPADE_MEMORY_API_KEYS"}
LOOPBACK = ("127.", "localhost", "[::1]", "::1")


def _hashes(servers: dict[str, str], variable: str) -> set[str]:
    return {t["key_sha256"] for t in json.loads(servers[variable])}


def _check_clients(settings: Any, servers: dict[str, str], what: str, embedded_inference: bool) -> None:
    """Every sandbox/memory endpoint names a deployed server (not this container's loopback) and
    carries a key that server's tenants list (by SHA-256), so the first call is not refused; with the
    embedded inference server, every inference client's key is among its api or admin keys (the
    learner's among the admin keys: it updates the weights).

    ``servers``: the environment the servers get (their ``SPADE_*_API_KEYS``).
    """
    from spade.endpoints import InferenceEndpoint, MemoryEndpoint, SandboxEndpoint

    for field, variable in SERVER_TENANTS.items():
        endpoint = getattr(settings, field, None)
        if not isinstance(endpoint, MemoryEndpoint | SandboxEndpoint):
            continue
        target = endpoint.target.removeprefix("dns:///")
        assert not target.startswith(LOOPBACK), (
            f"{what}: {field}.target={endpoint.target} is the container's own loopback, not the {field} service"
        )
        key = endpoint.key()
        assert key, f"{what}: no {field} key ({field}.api_key): the {field} refuses calls without one"
        assert hashlib.sha256(key.encode()).hexdigest() in _hashes(servers, variable), (
            f"{what}: its {field} key is not among the {field}'s tenants ({variable})"
        )
    inference = getattr(settings, "inference", None)
    if embedded_inference and isinstance(inference, InferenceEndpoint):
        admin = type(settings).__name__ == "LearnerSettings"
        variables = (
            ["SPADE_INFERENCE_ADMIN_KEYS"] if admin else ["SPADE_INFERENCE_API_KEYS", "SPADE_INFERENCE_ADMIN_KEYS"]
        )
        key = inference.key()
        assert key, f"{what}: no inference key (inference.api_key): the inference server refuses it"
        allowed = set().union(*(_hashes(servers, v) for v in variables))
        assert hashlib.sha256(key.encode()).hexdigest() in allowed, (
            f"{what}: its inference key is not among the inference server's {' or '.join(variables)}"
        )


def _check_paths(settings: Any, mounts: list[str], what: str) -> None:
    for field, path in _paths(settings):
        provided = any(path.is_relative_to(p) for p in (*IMAGE_PATHS, *mounts))
        assert provided, f"{what}: {field}={path} is neither in the image nor under a mount ({mounts})"


# --- Kubernetes ------------------------------------------------------------------------------------


def _k8s_containers() -> Iterator[tuple[str, str, dict[str, Any], dict[str, Any], dict[str, dict[str, str]]]]:
    for overlay in OVERLAYS:
        docs = render(overlay)
        configmaps = {
            (d["metadata"]["namespace"], d["metadata"]["name"]): d["data"] for d in docs if d["kind"] == "ConfigMap"
        }
        for doc in docs:
            pod = pod_spec(doc)
            if pod is None:
                continue
            ns = doc["metadata"]["namespace"]
            for container in pod["containers"]:
                yield (
                    overlay,
                    f"{doc['kind']}/{doc['metadata']['name']}",
                    pod,
                    container,
                    {name: data for (cns, name), data in configmaps.items() if cns == ns},
                )


def _k8s_env(container: dict[str, Any], configmaps: dict[str, dict[str, str]], what: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        name = source["configMapRef"]["name"]
        assert name in configmaps, f"{what}: envFrom names missing ConfigMap {name}"
        env.update(configmaps[name])
    for item in container.get("env") or []:
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        ref = item["valueFrom"]
        if "secretKeyRef" in ref:
            secret, key = ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"]
            assert key in SECRETS.get(secret, {}), f"{what}: {secret}/{key} is not in the secret template"
            env[item["name"]] = SECRETS[secret][key]
        elif "fieldRef" in ref:
            env[item["name"]] = "pod-0"
        elif "configMapKeyRef" in ref:
            env[item["name"]] = configmaps[ref["configMapKeyRef"]["name"]][ref["configMapKeyRef"]["key"]]
    return env


def test_every_k8s_service_container_builds_safe_settings_with_its_paths_mounted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: set[tuple[str, str]] = set()
    for overlay, what, _pod, container, configmaps in _k8s_containers():
        argv = [*(container.get("command") or []), *(container.get("args") or [])]
        service = _service_of(argv)
        where = f"{overlay}: {what}"
        env = _k8s_env(container, configmaps, where)
        if argv[:1] == ["migrate"]:
            assert env.get("SPADE_MEMORY_DATABASE_URL", "").startswith("postgresql"), where
            continue
        if service is None:
            continue
        _no_flags(argv, where)
        with monkeypatch.context() as mp:
            try:
                settings = build_settings(service, env, mp)
            except Exception as exc:
                raise AssertionError(f"{where}: spade serve {service} would refuse to start:\n{exc}") from None
        mounts = [m["mountPath"] for m in container.get("volumeMounts") or []]
        _check_paths(settings, mounts, where)
        secrets = {**SECRETS["spade-secrets"], **SECRETS["spade-sandbox-secrets"]}
        _check_clients(settings, secrets, where, embedded_inference=overlay == "dev")
        sc = container.get("securityContext") or {}
        if sc.get("readOnlyRootFilesystem"):
            assert "/tmp" in mounts, f"{where}: a read-only root needs a writable /tmp (HOME)"
        seen.add((overlay, service))
    for overlay in OVERLAYS:
        for service in ("sandbox", "memory", "designer", "rollout", "learner"):
            assert (overlay, service) in seen, f"{overlay}: no container runs {service}"
    assert ("dev", "inference") in seen


# --- docker-compose --------------------------------------------------------------------------------


def _compose_env() -> dict[str, str]:
    return read_env_file(ROOT / "deploy" / "compose" / "env.template")


def _env_files(service: dict[str, Any]) -> dict[str, str]:
    """What a service's env_file lines set, as compose reads them (relative to the compose file)."""
    return read_env_files([ROOT / path for path in service.get("env_file") or []], {})


def test_compose_and_the_process_runner_share_one_settings_file_and_run_spec() -> None:
    """deploy/spade.env is every spade container's env_file and the runner's first file; the run spec
    compose mounts is the one the runner stores; nothing either sets again shadows a shared line."""
    services = compose(_compose_env())["services"]
    shared = read_env_files([ROOT / "deploy" / "spade.env"], {})
    assert shared
    images = ("spade:latest", "spade-gpu:latest")
    spade_services = {n: s for n, s in services.items() if str(s.get("image", "")).endswith(images)}
    assert {"migrate", "sandbox", "memory", "designer", "rollout", "inference", "learner"} <= set(spade_services)
    for name, service in spade_services.items():
        assert service.get("env_file") == ["deploy/spade.env"], f"compose {name} does not read deploy/spade.env"
        shadowed = set(shared) & set(service.get("environment") or {})
        if name == "learner-gpu":  # the one documented exception: a CUDA learner
            assert shadowed == {"SPADE_LEARNER_DEVICE"}, shadowed
        else:
            assert not shadowed, f"compose {name} sets {shadowed} again: change deploy/spade.env instead"
    assert DEFAULT_ENV_FILES[0] == Path("deploy/spade.env")
    runner = read_env_files([ROOT / f for f in DEFAULT_ENV_FILES], {"SPADE_LOCAL_DATA_DIR": "/tmp/x"})
    inference, learner = services["inference"]["environment"], services["learner"]["environment"]
    assert inference["SPADE_INFERENCE_PUBLISHED_WEIGHTS_DIR"] == learner["SPADE_LEARNER_WEIGHTS_DIR"]
    mounted = services["memory"]["volumes"][0].split(":")[0].removeprefix("./")
    assert mounted == runner["SPADE_CLUSTER_RUN_SPEC"] == "deploy/runspec.yaml"


@pytest.mark.parametrize(("profile", "ci"), [("cpu", False), ("gpu", False), ("cpu", True)])
def test_every_compose_service_builds_safe_settings_with_its_paths_mounted(
    profile: str, ci: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    services = compose(_compose_env())["services"]
    if ci:  # the sizes tests/e2e/test_compose.py runs with, merged as `-f a -f b` merges them
        overrides = yaml.safe_load((ROOT / "tests" / "e2e" / "compose.ci.yml").read_text())["services"]
        for name, override in overrides.items():
            services[name]["environment"] = {**services[name]["environment"], **override["environment"]}
    started = set()
    for name, service in services.items():
        if set(service.get("profiles") or [profile]) != {profile}:
            continue
        argv = [str(a) for a in service.get("command") or []]
        target = _service_of(argv)
        if target is None:
            continue
        env = {**_env_files(service), **{k: str(v) for k, v in (service.get("environment") or {}).items()}}
        _no_flags(argv, f"compose {name}")
        with monkeypatch.context() as mp:
            try:
                settings = build_settings(target, env, mp)
            except Exception as exc:
                raise AssertionError(f"compose {name}: spade serve {target} would refuse to start:\n{exc}") from None
        mounts = [v.split(":")[1] for v in service.get("volumes") or []] + list(service.get("tmpfs") or [])
        _check_paths(settings, mounts, f"compose {name}")
        _check_clients(settings, _compose_env(), f"compose {name}", embedded_inference=profile == "cpu")
        started.add(target)
    expected = {"sandbox", "memory", "designer", "rollout", "learner"} | ({"inference"} if profile == "cpu" else set())
    assert expected <= started, f"profile {profile} starts {started}"


def test_compose_needs_every_secret_and_the_template_names_them_all() -> None:
    env = _compose_env()
    services = compose(env)["services"]
    assert services["migrate"]["command"] == ["migrate"]
    for key in env:
        with pytest.raises(KeyError, match=key):
            compose({k: v for k, v in env.items() if k != key})


def test_the_image_pins_its_no_deps_wheels_as_setup_sh_does() -> None:
    setup = dict(re.findall(r"'([A-Za-z0-9_.-]+)==([^']+)'", (ROOT / "scripts" / "setup.sh").read_text()))
    match = re.search(r'^ARG NO_DEPS_WHEELS="([^"]+)"', (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert match, "the Dockerfile lost its NO_DEPS_WHEELS line (scripts/containers/wheelhouse.sh reads it)"
    for pin in match.group(1).split():
        name, _, version = pin.partition("==")
        assert setup.get(name) == version, f"the image pins {pin}, scripts/setup.sh {name}=={setup.get(name)}"


def test_the_image_installs_the_torch_that_pyproject_pins() -> None:
    import tomllib

    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = next(p for p in pins if p.startswith("torch=="))
    assert f"ARG TORCH_VERSION={torch.removeprefix('torch==')}" in (ROOT / "Dockerfile").read_text()
