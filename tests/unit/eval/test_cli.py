"""spade eval's command line: bad input is one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from services.eval.cli import default_out, eval_group
from spade.cli import main


def _invoke(args: list[str], **env: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(eval_group, args, env=env)
    return result.exit_code, result.stdout, result.stderr


def _one_line(stderr: str) -> str:
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert stderr.startswith("spade eval: ")
    return stderr


def test_the_subcommand_is_registered_lazily() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert "eval" in result.output and "Score a checkpoint" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--suite", "mmlu"], "unknown suite 'mmlu'"),
        (["--limit", "3"], "--suite is required"),
    ],
)
def test_bad_arguments_exit_2(args: list[str], message: str) -> None:
    code, _, stderr = _invoke(args)
    assert code == 2 and message in _one_line(stderr)


def test_bad_settings_exit_2_naming_the_variable() -> None:
    code, _, stderr = _invoke(["--suite", "reasoning-gym"], SPADE_EVAL_CONCURRENCY="0")
    assert code == 2 and "SPADE_EVAL_CONCURRENCY" in _one_line(stderr)


@pytest.mark.slow
def test_a_missing_checkpoint_exits_1(tmp_path: Path) -> None:
    code, _, stderr = _invoke(["--suite", "reasoning-gym", "--model", str(tmp_path / "nope")])
    assert code == 1 and "no checkpoint at" in _one_line(stderr)
    (tmp_path / "empty").mkdir()
    code, _, stderr = _invoke(["--suite", "reasoning-gym", "--model", str(tmp_path / "empty")])
    assert code == 1 and "is not a checkpoint" in _one_line(stderr)


@pytest.mark.slow
def test_a_server_that_is_down_exits_1(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, _, stderr = _invoke(
        ["--suite", "reasoning-gym", "--model", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "o")]
    )
    assert code == 1 and "is not answering" in _one_line(stderr)


def test_the_pool_suite_needs_a_usable_pool(tmp_path: Path) -> None:
    code, _, stderr = _invoke(["--suite", "pool"])
    assert code == 1 and "needs a pool" in _one_line(stderr)
    code, _, stderr = _invoke(["--suite", "pool", "--pool", str(tmp_path / "missing.jsonl")])
    assert code == 1 and "no pool at" in _one_line(stderr)
    (tmp_path / "envs.jsonl").write_text('{"env_id": "a", "setting": "game", "status": "invalid", "code": "x"}\n')
    code, _, stderr = _invoke(["--suite", "pool", "--pool", str(tmp_path)])
    assert code == 1 and "no env that passed validation" in _one_line(stderr)


def test_unknown_datasets_fail_before_the_model_loads() -> None:
    code, _, stderr = _invoke(["--suite", "reasoning-gym"], SPADE_EVAL_REASONING_GYM__DATASETS='["nope"]')
    assert code == 1 and "no dataset 'nope'" in _one_line(stderr)


def test_the_default_out_directory_is_stable_per_command() -> None:
    assert default_out("pool", 3, "runs/x/last_checkpoint/") == Path("eval-runs/pool-seed3-runs_x_last_checkpoint")
    assert default_out("reasoning-gym", 0, None) == Path("eval-runs/reasoning-gym-seed0-default-model")
