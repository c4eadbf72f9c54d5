"""docker-compose.yml run for real, with podman: the images are built offline (a debootstrap base
and a host-built wheelhouse, both cached), the stack comes up with the shipped settings and run spec
(deploy/spade.env and deploy/runspec.yaml, which ``spade cluster up`` uses too), every HTTP /healthz and gRPC health
check answers, the seed pool is loaded, the learner publishes a weight version after the designer's
samples have reached it, an environment is read through the memory's REST API, and the stack goes
down with its volumes.

Slow (builds images on a cold machine, runs the real model on CPU): it runs in ``make test``.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.machine import timed_out

# Bounded so that a hung stack cannot eat CI's budget: a cold image build (about 6 minutes with a
# warm pip cache, more when every wheel is downloaded) plus a slow stack fit.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2100)]

#: From `up` to every server healthy (about 30 s on 2 busy cores: the model loads twice).
HEALTHY_TIMEOUT_S = 300
#: From a healthy stack to the first published weight version (one learner step).
STEP_TIMEOUT_S = 600

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILES = ["-f", str(ROOT / "docker-compose.yml"), "-f", str(ROOT / "tests" / "e2e" / "compose.ci.yml")]
PODMAN_COMPOSE = Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin" / "podman-compose"
CONTAINERS_CONF = ROOT / "deploy" / "containers" / "containers.conf"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class Stack:
    """One compose project: its name, its environment (secrets made for this run) and helpers."""

    def __init__(self) -> None:
        self.project = f"spadeci{uuid.uuid4().hex[:8]}"
        self.designer_key, self.rollout_key = secrets.token_hex(16), secrets.token_hex(16)
        self.seed_key, self.token = secrets.token_hex(16), secrets.token_hex(16)
        self.designer_memory_key, self.rollout_memory_key = secrets.token_hex(16), secrets.token_hex(16)
        self.learner_memory_key = secrets.token_hex(16)
        self.inference_keys = {role: secrets.token_hex(16) for role in ("designer", "rollout", "learner")}
        self.memory_port, self.sandbox_port = _free_port(), _free_port()
        tenants = [
            {"tenant": "designer", "key_sha256": _sha256(self.designer_key)},
            {"tenant": "rollout", "key_sha256": _sha256(self.rollout_key), "max_sessions": 64},
            {"tenant": "seed", "key_sha256": _sha256(self.seed_key)},
        ]
        self.env = {
            **os.environ,
            "CONTAINERS_CONF": str(CONTAINERS_CONF),
            "SPADE_POSTGRES_PASSWORD": secrets.token_hex(12),
            "SPADE_MEMORY_API_KEYS": json.dumps(
                [
                    {"tenant": "e2e", "key_sha256": _sha256(self.token), "role": "admin"},
                    {"tenant": "designer", "key_sha256": _sha256(self.designer_memory_key), "role": "write"},
                    {"tenant": "rollout", "key_sha256": _sha256(self.rollout_memory_key), "role": "write"},
                    {"tenant": "learner", "key_sha256": _sha256(self.learner_memory_key), "role": "write"},
                ]
            ),
            "SPADE_DESIGNER_MEMORY_KEY": self.designer_memory_key,
            "SPADE_ROLLOUT_MEMORY_KEY": self.rollout_memory_key,
            "SPADE_LEARNER_MEMORY_KEY": self.learner_memory_key,
            "SPADE_DESIGNER_INFERENCE_KEY": self.inference_keys["designer"],
            "SPADE_ROLLOUT_INFERENCE_KEY": self.inference_keys["rollout"],
            "SPADE_LEARNER_INFERENCE_KEY": self.inference_keys["learner"],
            "SPADE_INFERENCE_API_KEYS": json.dumps(
                [{"tenant": role, "key_sha256": _sha256(self.inference_keys[role])} for role in ("designer", "rollout")]
            ),
            "SPADE_INFERENCE_ADMIN_KEYS": json.dumps(
                [{"tenant": "learner", "key_sha256": _sha256(self.inference_keys["learner"])}]
            ),
            "SPADE_DESIGNER_SANDBOX_KEY": self.designer_key,
            "SPADE_ROLLOUT_SANDBOX_KEY": self.rollout_key,
            "SPADE_SANDBOX_API_KEYS": json.dumps(tenants),
            "SPADE_MEMORY_REST_PORT": str(self.memory_port),
            "SPADE_SANDBOX_HTTP_PORT": str(self.sandbox_port),
        }

    def compose(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [str(PODMAN_COMPOSE), "-p", self.project, *COMPOSE_FILES, "--profile", "cpu", *args]
        try:
            out = subprocess.run(
                cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(timed_out(exc)) from exc
        if check and out.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
            )
        return out

    def container(self, service: str) -> str:
        """The podman name of ``service``'s (first) container."""
        out = subprocess.run(
            ["podman", "ps", "-a", "--filter", f"label=io.podman.compose.project={self.project}",
             "--filter", f"label=io.podman.compose.service={service}", "--format", "{{.Names}}"],
            env=self.env, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        names = out.stdout.split()
        assert names, f"no container for {service}"
        return names[0]

    def exec(self, service: str, *argv: str, timeout: float = 300) -> str:
        out = subprocess.run(
            ["podman", "exec", self.container(service), *argv],
            env=self.env, capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
        assert out.returncode == 0, (
            f"{service}: {argv} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}\n{self.logs()}"
        )
        return out.stdout

    def logs(self) -> str:
        """Every container's log tail, for failure messages."""
        tails = []
        for service in ("migrate", "sandbox", "memory", "inference", "designer", "rollout", "learner"):
            try:
                name = self.container(service)
            except AssertionError:
                continue
            out = subprocess.run(
                ["podman", "logs", "--tail", "25", name], env=self.env, capture_output=True, text=True, check=False
            )
            tails.append(f"--- {service}\n{out.stdout[-2500:]}{out.stderr[-2500:]}")
        return "\n".join(tails)

    def log(self, service: str) -> str:
        out = subprocess.run(
            ["podman", "logs", self.container(service)], env=self.env, capture_output=True, text=True, check=False
        )
        return out.stdout + out.stderr

    def assert_running(self) -> None:
        """Every long-running service is still up (a crash fails the test at once, with its log)."""
        names = subprocess.run(
            ["podman", "ps", "-a", "-q", "--filter", f"label=io.podman.compose.project={self.project}"],
            env=self.env, capture_output=True, text=True, timeout=60, check=True,
        ).stdout.split()  # fmt: skip
        out = subprocess.run(
            ["podman", "inspect", "--format", "{{.Name}} {{.State.Status}} {{.State.ExitCode}}", *names],
            env=self.env, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        for line in out.stdout.splitlines():
            name, state, code = line.split()[:3]
            if "migrate" in name:
                assert state != "exited" or code == "0", f"migrate failed ({code})\n{self.logs()}"
            else:
                assert state == "running", f"{name} is {state} ({code})\n{self.logs()}"


def _wait(what: str, probe: Any, stack: Stack, timeout_s: float, every_s: float = 2.0) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        stack.assert_running()
        try:
            last = probe()
        except (OSError, AssertionError, ValueError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s} s (last: {last!r})\n{stack.logs()}")


def _http_text(url: str) -> str:
    """The body of an open GET (``/healthz``: the bare word ``ok``)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        body: str = response.read().decode()
    assert body == "ok", body
    return body


def _http_json(url: str, token: str | None = None) -> Any:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


GRPC_HEALTH = """
import sys, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
for target in sys.argv[1:]:
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, (target, reply)
print("SERVING")
"""


@pytest.fixture(scope="module")
def images() -> Iterator[None]:
    """Podman and the images (cached between runs: see scripts/containers/)."""
    assert shutil.which("bash")
    started = time.monotonic()
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "containers" / "build-images.sh")],
        cwd=ROOT, capture_output=True, text=True, timeout=1500, check=False,
    )  # fmt: skip
    assert out.returncode == 0, f"building the images failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    print(f"images ready in {time.monotonic() - started:.0f} s")
    yield


@pytest.fixture
def stack(images: None) -> Iterator[Stack]:
    stack = Stack()
    try:
        yield stack
    finally:
        stack.compose("down", "-v", "-t", "10", timeout=600, check=False)


def test_the_compose_stack_runs_a_learner_step(stack: Stack) -> None:
    started = time.monotonic()
    stack.compose("up", "-d", timeout=900)

    # The one-shot migration ran, the servers answer their HTTP and gRPC health checks.
    def migrated() -> bool:
        state = subprocess.run(
            ["podman", "inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", stack.container("migrate")],
            env=stack.env, capture_output=True, text=True, timeout=60, check=True,
        ).stdout.split()  # fmt: skip
        return state == ["exited", "0"]

    healthy_deadline = time.monotonic() + HEALTHY_TIMEOUT_S

    def left() -> float:
        return max(1.0, healthy_deadline - time.monotonic())

    _wait("the migrate one-shot", migrated, stack, left())
    _wait("sandbox /healthz", lambda: _http_text(f"http://127.0.0.1:{stack.sandbox_port}/healthz"), stack, left())
    _wait("memory /healthz", lambda: _http_text(f"http://127.0.0.1:{stack.memory_port}/healthz"), stack, left())
    assert "SERVING" in stack.exec("designer", "python", "-c", GRPC_HEALTH, "sandbox:50051", "memory:50052")
    health = "import urllib.request; print(urllib.request.urlopen('http://inference:30000/health', timeout=5).status)"
    _wait("inference /health", lambda: "200" in stack.exec("designer", "python", "-c", health), stack, left(), 5)
    print(f"stack healthy after {time.monotonic() - started:.0f} s")

    # The seed pool, loaded as an operator would (validated by the sandbox, stored, announced).
    seeded = stack.exec(
        "memory", "spade", "envs", "seed", "--memory", "memory:50052", "--memory-key", stack.token,
        "--queue", json.dumps({"kind": "redis", "url": "redis://redis:6379/0"}),
        "--sandbox", "sandbox:50051", "--sandbox-key", stack.seed_key, "--example", "number_hunt",
    )  # fmt: skip
    assert "seed pool: 1 game environment stored" in seeded, seeded
    env_id = seeded.split()[-1]

    # The designer's samples reach the learner: its consumer group has read from samples.designer.
    def designer_samples_read() -> bool:
        groups = stack.exec("redis", "redis-cli", "--json", "XINFO", "GROUPS", "spade:{samples.designer}")
        return any(g.get("name") == "learner" and int(g.get("entries-read") or 0) >= 1 for g in json.loads(groups))

    # The learner publishes weight version 1 (to the inference server, announced on the stream).
    # Not XLEN: an entry every consumer group has acknowledged is deleted (spade.queues.redis_streams),
    # so the stream is empty again once the rollout and the designer have read the announcement.
    def published() -> bool:
        info = json.loads(stack.exec("redis", "redis-cli", "--json", "XINFO", "STREAM", "spade:{weights.published}"))
        return int(info.get("entries-added") or 0) >= 1

    # One learner step takes about 2 minutes on 2 busy cores (the round's plays, then one GRPO step);
    # the deadline leaves room for a slower machine without letting a stuck stack eat CI's budget.
    step_deadline = time.monotonic() + STEP_TIMEOUT_S
    _wait("designer samples read by the learner", designer_samples_read, stack, STEP_TIMEOUT_S, 5)
    _wait("a published weight version", published, stack, max(1.0, step_deadline - time.monotonic()), 5)
    model_info = (  # with the designer's own inference key: generation routes need one
        "import os, urllib.request; print(urllib.request.urlopen(urllib.request.Request("
        "'http://inference:30000/model_info', headers={'Authorization': "
        "'Bearer ' + os.environ['SPADE_DESIGNER_INFERENCE__API_KEY']})).read().decode())"
    )
    info = json.loads(stack.exec("designer", "python", "-c", model_info))
    assert str(info["weight_version"]) != "0", f"the inference server still serves the base weights: {info}"
    print(f"weight version 1 after {time.monotonic() - started:.0f} s")

    # An environment, read through the memory's REST API (bearer token).
    page = _http_json(f"http://127.0.0.1:{stack.memory_port}/v1/environments", stack.token)
    assert env_id in {item["id"] for item in page["items"]}
    detail = _http_json(f"http://127.0.0.1:{stack.memory_port}/v1/environments/{env_id}", stack.token)
    assert detail["id"] == env_id
    stack.assert_running()
