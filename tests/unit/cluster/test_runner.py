"""The process runner's configuration: the env file's rules, the generated keys, the members in order."""

from __future__ import annotations

import doctest
import json
import stat
from pathlib import Path

import pytest

from services.cluster import envfile
from services.cluster.envfile import DEFAULT_ENV_FILES, EnvFileError, parse_env_lines, read_env_files
from services.cluster.runner import Cluster
from spade.auth import hash_key

ROOT = Path(__file__).resolve().parents[3]


def test_doctests() -> None:
    failures, tried = doctest.testmod(envfile)
    assert tried and not failures


def test_a_reference_to_an_unset_variable_names_the_line() -> None:
    with pytest.raises(EnvFileError, match=r"env file:2: \$\{NOPE\} is not set"):
        parse_env_lines(["A=1", "B=${NOPE}"], {})


def _cluster(tmp_path: Path, **environ: str) -> Cluster:
    return Cluster([ROOT / f for f in DEFAULT_ENV_FILES], environ={"SPADE_LOCAL_DATA_DIR": str(tmp_path), **environ})


def test_a_later_file_wins_over_an_earlier_one_and_may_refer_to_it(tmp_path: Path) -> None:
    (tmp_path / "a.env").write_text("A=1\nB=2\n")
    (tmp_path / "b.env").write_text("B=${A}0\nC=${B}x\n")
    assert read_env_files([tmp_path / "a.env", tmp_path / "b.env"], {}) == {"A": "1", "B": "10", "C": "10x"}
    assert read_env_files([tmp_path / "a.env", tmp_path / "b.env"], {"B": "9"})["C"] == "9x"


@pytest.mark.model
def test_the_shared_settings_reach_the_services_and_local_env_does_not_shadow_them(tmp_path: Path) -> None:
    shared = read_env_files([ROOT / "deploy" / "spade.env"], {})
    local = read_env_files([ROOT / "deploy" / "local.env"], {"SPADE_LOCAL_DATA_DIR": str(tmp_path)})
    assert shared and not set(shared) & set(local), "a setting compose shares is set again in local.env"
    env = _cluster(tmp_path).env()
    assert {k: env[k] for k in shared} == shared
    # A restarted inference server reads the learner's published versions.
    assert env["SPADE_INFERENCE_PUBLISHED_WEIGHTS_DIR"] == env["SPADE_LEARNER_WEIGHTS_DIR"]


@pytest.mark.model
def test_keys_are_generated_once_private_and_accepted_by_each_server(tmp_path: Path) -> None:
    cluster = _cluster(tmp_path)
    keys = cluster.keys()
    path = tmp_path / "keys.env"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert _cluster(tmp_path).keys() == keys
    env = cluster.env()
    sandbox = {t["tenant"]: t["key_sha256"] for t in json.loads(env["SPADE_SANDBOX_API_KEYS"])}
    memory = {t["tenant"]: t["key_sha256"] for t in json.loads(env["SPADE_MEMORY_API_KEYS"])}
    admin = {t["tenant"]: t["key_sha256"] for t in json.loads(env["SPADE_INFERENCE_ADMIN_KEYS"])}
    assert hash_key(env["SPADE_ROLLOUT_SANDBOX__API_KEY"]) == sandbox["rollout"]
    assert hash_key(env["SPADE_DESIGNER_MEMORY__API_KEY"]) == memory["designer"]
    assert hash_key(env["SPADE_LEARNER_MEMORY__API_KEY"]) == memory["learner"]
    assert hash_key(env["SPADE_LEARNER_INFERENCE__API_KEY"]) == admin["learner"]


def test_members_start_in_order_with_one_consumer_name_per_rollout_worker(tmp_path: Path) -> None:
    cluster = _cluster(tmp_path, SPADE_CLUSTER_ROLLOUT_WORKERS="3", SPADE_LEARNER_MODEL_PATH=str(tmp_path))
    names = [m.name for m in cluster.members()]
    assert names == ["sandbox", "memory", "inference", "learner", "rollout-1", "rollout-2", "rollout-3", "designer"]
    workers = [m for m in cluster.members() if m.role == "rollout"]
    assert [m.env["SPADE_ROLLOUT_CONSUMER_NAME"] for m in workers] == ["rollout-1", "rollout-2", "rollout-3"]


def test_a_port_set_in_the_environment_moves_every_address_built_from_it(tmp_path: Path) -> None:
    env = _cluster(tmp_path, SPADE_LOCAL_MEMORY_GRPC_PORT="60052", SPADE_CLUSTER_SERVICES="sandbox,memory").env()
    assert env["SPADE_MEMORY_GRPC__PORT"] == "60052"
    assert env["SPADE_ROLLOUT_MEMORY__TARGET"] == env["SPADE_LEARNER_MEMORY__TARGET"] == "127.0.0.1:60052"
    assert _cluster(tmp_path, SPADE_CLUSTER_SERVICES="sandbox,memory").settings.services == ["sandbox", "memory"]


def test_a_runner_setting_the_file_leaves_out_is_read_from_the_environment(tmp_path: Path) -> None:
    assert _cluster(tmp_path).settings.stop_grace_s == 40.0
    assert _cluster(tmp_path, SPADE_CLUSTER_STOP_GRACE_S="5").settings.stop_grace_s == 5.0


def test_a_worker_up_finds_running_is_not_waited_for_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.cluster import runner

    cluster = _cluster(tmp_path)
    monkeypatch.setattr(cluster, "alive", lambda pid: True)
    worker = runner.Member("rollout-1", "rollout", ("serve", "rollout"))
    slept: list[float] = []
    monkeypatch.setattr(runner.time, "sleep", slept.append)
    cluster.wait_healthy(worker, 1234, ran_s=runner.WORKER_SETTLE_S + 60)
    assert slept == []  # settled long ago


def test_the_data_dir_queue_prefix_and_database_set_in_the_environment_move_every_service(tmp_path: Path) -> None:
    # What tests/e2e/test_distributed.py overrides to run the shipped cluster beside another one.
    url = "postgresql+psycopg://postgres@127.0.0.1:5432/other"
    cluster = _cluster(
        tmp_path,
        SPADE_LOCAL_QUEUE_PREFIX="e2e-1:",
        SPADE_LOCAL_DATABASE_URL=url,
        SPADE_LEARNER_MODEL_PATH=str(tmp_path),
    )
    env = cluster.env()
    assert cluster.run_dir == tmp_path.resolve()
    assert env["SPADE_LEARNER_WEIGHTS_DIR"].startswith(str(tmp_path))
    assert env["SPADE_LEARNER_CHECKPOINT_DIR"].startswith(str(tmp_path))
    for service in ("LEARNER", "ROLLOUT", "DESIGNER"):
        assert json.loads(env[f"SPADE_{service}_QUEUE"])["prefix"] == "e2e-1:"
    assert Cluster.queue_config(env)["prefix"] == "e2e-1:"
    assert env["SPADE_MEMORY_DATABASE_URL"] == env["SPADE_ROLLOUT_STATE_URL"] == url


def test_a_member_just_started_counts_as_running_even_before_its_command_line_reads_spade(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Right after the fork, /proc/PID/cmdline can read empty (the exec is under way): `up` must not
    # report such a member as exited while starting.
    from services.cluster import runner

    cluster = _cluster(tmp_path)
    monkeypatch.setattr(runner, "SPADE", ["sleep"])
    monkeypatch.setattr(runner, "WORKER_SETTLE_S", 0.2)
    monkeypatch.setattr(cluster, "alive", lambda pid: False)
    worker = runner.Member("rollout-1", "rollout", ("30",))
    pid = cluster.start(worker, {"PATH": "/usr/bin:/bin"})
    try:
        cluster.wait_healthy(worker, pid)
        assert cluster.running(pid)
    finally:
        cluster._children[pid].kill()
        cluster._children[pid].wait(10)
    assert not cluster.running(pid)


def test_each_generated_memory_key_has_the_role_its_holder_needs_and_no_more(tmp_path: Path) -> None:
    from services.memory.settings import MemorySettings
    from spade.auth import Role

    keys = _cluster(tmp_path).keys()
    memory = MemorySettings.model_validate({"api_keys": json.loads(keys["SPADE_MEMORY_API_KEYS"])})
    roles = {k.tenant: k.role for k in memory.api_keys}
    # The operator's key sets the run spec (`spade runspec set`); the services' only store.
    assert roles == {"operator": Role.ADMIN, "designer": Role.WRITE, "rollout": Role.WRITE, "learner": Role.WRITE}
    ring = memory.keyring()
    assert getattr(ring.verify(keys["SPADE_MEMORY_API_KEY"]), "role", None) is Role.ADMIN  # what the CLIs send
    assert getattr(ring.verify(keys["SPADE_ROLLOUT_MEMORY__API_KEY"]), "role", None) is Role.WRITE


def test_a_keys_file_from_before_roles_gets_them_when_read(tmp_path: Path) -> None:
    """A cluster's keys.env written before memory keys had roles: the operator still sets the run spec."""
    old = [{"tenant": n, "key_sha256": hash_key(n)} for n in ("operator", "designer", "rollout", "learner")]
    (tmp_path / "keys.env").write_text(f"SPADE_MEMORY_API_KEYS='{json.dumps(old)}'\n")
    read = json.loads(_cluster(tmp_path).keys()["SPADE_MEMORY_API_KEYS"])
    assert {t["tenant"]: t["role"] for t in read} == {
        "operator": "admin",
        "designer": "write",
        "rollout": "write",
        "learner": "write",
    }
