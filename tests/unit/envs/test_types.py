"""Result and config types: JSON round trips, bounds with clear errors, and the modules' doctests."""

from __future__ import annotations

import doctest
import importlib
import json

import pytest

from spade.envs.types import CHECK_NAMES, CheckConfig, CheckResult, FinishReason, Outcome, Setting, ValidationReport


def test_check_names_are_exactly_the_design_checks() -> None:
    assert CHECK_NAMES == (
        "syntax", "structure", "smoke", "determinism", "seed_variety", "solution_replay",
        "random_policy", "termination", "reset_gate", "irrelevant_action",
    )  # fmt: skip


def test_enums_are_strings_on_the_wire() -> None:
    assert [o.value for o in Outcome] == [
        "ok",
        "env_error",
        "timeout",
        "limit",
        "cpu_limit",
        "memory_limit",
        "output_limit",
        "killed",
        "sandbox_fault",
    ]
    assert Setting.parse(" Tool ") is Setting.TOOL and Setting.parse(Setting.GAME) is Setting.GAME
    assert json.dumps({"o": Outcome.LIMIT}) == '{"o": "limit"}'


def test_every_failing_call_has_its_own_finish_reason() -> None:
    failing = [o for o in Outcome if o not in (Outcome.OK, Outcome.SANDBOX_FAULT)]
    reasons = [FinishReason.for_outcome(o) for o in failing]
    assert len(set(reasons)) == len(failing), "two call outcomes collapse into one finish reason"
    assert FinishReason.for_outcome(Outcome.MEMORY_LIMIT) is FinishReason.FAULT_MEMORY
    assert FinishReason.for_outcome(Outcome.LIMIT) is FinishReason.TURN_LIMIT
    assert [r for r in FinishReason if r.is_resource_fault] == [
        FinishReason.FAULT_WALL_CLOCK,
        FinishReason.FAULT_CPU,
        FinishReason.FAULT_MEMORY,
        FinishReason.FAULT_OUTPUT,
        FinishReason.FAULT_KILLED,
    ]
    for passthrough in (Outcome.OK, Outcome.SANDBOX_FAULT):
        with pytest.raises(ValueError, match="does not end a play"):
            FinishReason.for_outcome(passthrough)


def test_check_config_round_trip_and_defaults() -> None:
    config = CheckConfig(seed_count=2, call_time_limit_s=0.5)
    assert CheckConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert CheckConfig().seed_count == 4
    assert CheckConfig().max_turns_cap == 25
    assert CheckConfig().effective_max_turns(10) == 10 and CheckConfig().effective_max_turns(True) == 25


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"seed_count": 1}, "seed_count must be an int in [2, 64]"),
        ({"seed_count": 65}, "seed_count must be an int in [2, 64]"),
        ({"call_time_limit_s": 0}, "call_time_limit_s must be in (0, 60]"),
        ({"random_policy_max_win_rate": 1.5}, "random_policy_max_win_rate must be in [0, 1]"),
        ({"observation_cap": 10}, "observation_cap must be in [100, 1000000]"),
    ],
)
def test_check_config_rejects_out_of_bounds_values(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as raised:
        CheckConfig(**kwargs)
    assert fragment in str(raised.value)


def test_fixed_validation_seeds_are_refused_with_the_reason() -> None:
    """Validation draws its seeds in secret: a config naming fixed ones is an error that says so."""
    for field in ("seeds", "random_policy_seed"):
        with pytest.raises(ValueError, match="draws its seeds in secret for each run; set seed_count"):
            CheckConfig.from_dict({field: [0, 1, 2, 3] if field == "seeds" else 1234})


def test_check_config_from_dict_rejects_unknown_fields() -> None:
    with pytest.raises(ValueError, match="unknown CheckConfig fields \\['sedes'\\]"):
        CheckConfig.from_dict({"sedes": [1, 2]})


def test_report_lookup_and_summary() -> None:
    checks = [CheckResult(n, n != "smoke", f"{n} detail") for n in CHECK_NAMES]
    report = ValidationReport(False, "game", "XEnv", checks, "code")
    assert report.check("smoke").detail == "smoke detail"
    assert report.summary() == "smoke: smoke detail"
    with pytest.raises(KeyError, match="no check named 'speed'"):
        report.check("speed")


@pytest.mark.parametrize("module", ["actions", "repair", "schema", "types", "session"])
def test_doctests(module: str) -> None:
    result = doctest.testmod(importlib.import_module(f"spade.envs.{module}"))
    assert result.failed == 0 and result.attempted > 0
