"""``spade serve inference``: reachable through the main CLI, and clear about bad input."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from spade.cli import main


def test_help_lists_the_model_option() -> None:
    result = CliRunner().invoke(main, ["serve", "inference", "--help"])
    assert result.exit_code == 0, result.output
    assert "--model" in result.output and "--port" in result.output


def test_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["serve", "inference", "--model", str(tmp_path)])
    assert result.exit_code != 0
    assert "not a Hugging Face checkpoint" in result.output


def test_an_exposed_host_is_refused_outside_dev_mode(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["serve", "inference", "--host", "0.0.0.0", "--model", str(tmp_path)])
    assert result.exit_code == 2
    assert "http.host='0.0.0.0' exposes generation without a key" in result.output


def test_the_weights_option_names_its_choices() -> None:
    result = CliRunner().invoke(main, ["serve", "inference", "--help"])
    assert "--weights [float32|bf16|int8|int4]" in result.output
    result = CliRunner().invoke(main, ["serve", "inference", "--weights", "int2"])
    assert result.exit_code == 2
    assert "'int2' is not one of 'float32', 'bf16', 'int8', 'int4'" in result.output
