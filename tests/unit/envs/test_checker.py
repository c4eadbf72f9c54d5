"""The checker: every example passes; one defective env per check and per DESIGN §6 defect fails
with that check named."""

from __future__ import annotations

import json

import pytest

from spade.envs.check_context import CheckContext
from spade.envs.checker import CHECKS, check_env_source
from spade.envs.examples import EXAMPLES
from spade.envs.findings import CheckFailed
from spade.envs.types import CHECK_NAMES, CheckConfig, Setting, ValidationReport
from tests.unit.envs.sample_envs import GUESS_GAME, NOTES_TOOL, mutate


def failed(report: ValidationReport) -> list[str]:
    return [c.name for c in report.failed]


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_example_env_passes_every_check(name: str) -> None:
    example = EXAMPLES[name]
    report = check_env_source(example.code, example.setting)
    assert report.valid, report.summary()
    assert [c.name for c in report.checks] == list(CHECK_NAMES)
    assert all(c.detail for c in report.checks)
    assert report.env_class.endswith("Env") and report.repaired_code == example.code


@pytest.mark.parametrize(("code", "setting"), [(GUESS_GAME, "game"), (NOTES_TOOL, "tool")])
def test_the_sample_envs_are_valid(code: str, setting: str) -> None:
    report = check_env_source(code, setting)
    assert report.valid, report.summary()


def test_game_envs_pass_tool_only_checks_as_not_applicable() -> None:
    report = check_env_source(GUESS_GAME, "game")
    for name in ("reset_gate", "irrelevant_action"):
        assert report.check(name).passed and report.check(name).detail == "not applicable to game envs"


def test_report_round_trips_as_json() -> None:
    report = check_env_source(GUESS_GAME, "game")
    assert ValidationReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report


def test_repairs_are_applied_and_reported() -> None:
    code = mutate(GUESS_GAME, 'obs = "Reply with \\\\boxed{N}."', 'obs = f"Reply with \\\\boxed{N} ({self.turn})."')
    report = check_env_source(code, "game")
    assert report.valid, report.summary()
    assert "\\\\boxed{{N}}" in report.repaired_code and "after repairs" in report.check("syntax").detail


def test_syntax_failure_blocks_every_later_check_naming_it() -> None:
    report = check_env_source(mutate(GUESS_GAME, "def step(self, action):", "def step(self, action)"), "game")
    assert not report.valid and "line " in report.check("syntax").detail
    for name in ("structure", "smoke", "determinism", "solution_replay", "random_policy", "termination"):
        assert report.check(name).detail == "not run: blocked by the failed 'syntax' check"
    assert report.check("reset_gate").passed  # not applicable to game envs


def test_smoke_failure_blocks_the_checks_that_need_it() -> None:
    code = mutate(GUESS_GAME, 'return "Correct!", 1.0, True, False, {}', 'return "Correct!", 1.0, True')
    code = mutate(code, 'return obs, 0.0, False, False, {"turn": self.turn}', "return obs, 0.0, False")
    report = check_env_source(code, "game")
    assert failed(report) == ["smoke", "determinism", "seed_variety", "solution_replay", "random_policy", "termination"]
    assert "step() must return (observation, reward, terminated, truncated, info), got a tuple of 3" in (
        report.check("smoke").detail
    )
    assert report.check("solution_replay").detail == "not run: blocked by the failed 'smoke' check"


# One defective env per check: (code, setting, the check that must fail, a fragment of its detail).
DEFECTS = {
    "structure: no env class": (
        mutate(GUESS_GAME, "class GuessEnv:", "class Guess:"),
        "game",
        "structure",
        "no class whose name ends in 'Env'",
    ),
    "structure: two env classes": (
        GUESS_GAME + "\n\nclass SecondEnv:\n    pass\n",
        "game",
        "structure",
        "several env classes",
    ),
    "structure: missing solution": (
        mutate(GUESS_GAME, "def solution(self):", "def answer(self):"),
        "game",
        "structure",
        "missing solution()",
    ),
    "structure: malformed tool schema": (
        mutate(
            NOTES_TOOL,
            '"items": {"type": "string", "enum": ["work", "home"]}',
            '"items": {"type": "string", "enum": []}',
        ),
        "tool",
        "structure",
        "enum must be a non-empty list",
    ),
    "smoke: negative reward": (
        mutate(
            GUESS_GAME,
            'obs = "Reply with \\\\boxed{N}."\n',
            'return "Reply with \\\\boxed{N}.", -0.1, False, False, {}\n',
        ),
        "game",
        "smoke",
        "rewards must lie in [0, 1]",
    ),
    "smoke: non-finite reward": (
        mutate(
            GUESS_GAME,
            'return obs, 0.0, False, False, {"turn": self.turn}',
            'return obs, float("inf"), False, False, {}',
        ),
        "game",
        "smoke",
        "reward must be finite",
    ),
    "smoke: reset raises": (
        mutate(GUESS_GAME, "self.turn = 0\n        return", "self.turn = 0 / 0\n        return"),
        "game",
        "smoke",
        "ZeroDivisionError",
    ),
    "determinism: global RNG unseeded": (
        mutate(GUESS_GAME, "self.secret = self.rng.randint(1, 1000)", "self.secret = random.randint(1, 1000)"),
        "game",
        "determinism",
        "global random module",
    ),
    "determinism: global RNG seeded by the env (reference TradingGameEnv)": (
        mutate(
            GUESS_GAME,
            "self.rng = random.Random(seed)\n        self.secret",
            "random.seed(seed)\n        self.rng = random\n        self.secret",
        ),
        "game",
        "determinism",
        "global random module",
    ),
    "determinism: wall clock": (
        mutate(
            GUESS_GAME,
            "self.secret = self.rng.randint(1, 1000)",
            "import time\n        self.secret = time.perf_counter_ns() % 1000 + 1",
        ),
        "game",
        "determinism",
        "differ",
    ),
    "seed_variety: one memorisable instance": (
        mutate(GUESS_GAME, "random.Random(seed)", "random.Random(42)"),
        "game",
        "seed_variety",
        "gave the same instance",
    ),
    "solution_replay: solution() does not win": (
        mutate(GUESS_GAME, "str(self.secret)", "str(self.secret + 1)"),
        "game",
        "solution_replay",
        "did not",
    ),
    "solution_replay: solution() is not a list of actions": (
        mutate(GUESS_GAME, 'return ["\\\\boxed{500}", "\\\\boxed{" + str(self.secret) + "}"]', "return self.secret"),
        "game",
        "solution_replay",
        "non-empty list of action strings",
    ),
    "random_policy: any guess wins": (
        mutate(GUESS_GAME, "elif int(match.group(1)) == self.secret:", "elif match is not None:"),
        "game",
        "random_policy",
        "the reward is trivial or hackable",
    ),
    "random_policy: unparseable replies win": (
        mutate(GUESS_GAME, 'obs = "Reply with \\\\boxed{N}."', 'return "ok", 1.0, True, False, {}'),
        "game",
        "random_policy",
        "won",
    ),
    "termination: never ends by itself": (
        mutate(GUESS_GAME, "if self.turn >= self.max_turns:", "if False:"),
        "game",
        "termination",
        "neither terminated nor truncated",
    ),
    "termination: bad max_turns": (
        mutate(GUESS_GAME, "max_turns = 12", "max_turns = 12.0"),
        "game",
        "termination",
        "max_turns must be a positive int",
    ),
    "reset_gate: criterion already true at reset": (
        mutate(NOTES_TOOL, '{c: {"body": "old", "meta": {"tags": ["home"]}}}', "{}"),
        "tool",
        "reset_gate",
        "already true right after reset()",
    ),
    "irrelevant_action: any call advances": (
        mutate(
            NOTES_TOOL,
            'lambda s: s["notes"].get(a) == {"body": "draft", "meta": {"tags": ["work"]}},',
            'lambda s: s["touched"],',
        ),
        "tool",
        "irrelevant_action",
        "is not part of its solution",
    ),
    "irrelevant_action: a skipped solution step still completes": (
        mutate(
            NOTES_TOOL,
            '[{"name": "add_note", "arguments": {"title": self.a,',
            '[{"name": "search", "arguments": {"query": self.a}}, {"name": "add_note", "arguments": {"title": self.a,',
        ),
        "tool",
        "irrelevant_action",
        "skipping solution call 1 (search)",
    ),
    "solution_replay: tool solution does not flip its criterion": (
        mutate(
            NOTES_TOOL,
            '"body": "final", "meta": {"tags": ["home"], "pinned": True}}}]',
            '"body": "final", "meta": {"tags": ["home"]}}}]',
        ),
        "tool",
        "solution_replay",
        "did not go False->True",
    ),
    "seed_variety: tool instance ignores the seed": (
        mutate(NOTES_TOOL, "rng.sample(TOPICS, 3)", "TOPICS[:3]"),
        "tool",
        "seed_variety",
        "gave the same instance",
    ),
    "determinism: tool env draws from the global RNG": (
        mutate(NOTES_TOOL, "rng.sample(TOPICS, 3)", "random.sample(TOPICS, 3)"),
        "tool",
        "determinism",
        "global random module",
    ),
}


# Earlier checks that rightly fail too for some defects.
ALSO_FAILS = {
    # A criterion true at reset also can never flip when its instruction arrives.
    "reset_gate: criterion already true at reset": ("solution_replay",),
}


@pytest.mark.parametrize("case", sorted(DEFECTS))
def test_each_defect_fails_its_named_check(case: str) -> None:
    code, setting, check, fragment = DEFECTS[case]
    report = check_env_source(code, setting)
    assert not report.valid
    result = report.check(check)
    assert not result.passed, f"{check} passed: {result.detail}"
    assert fragment in result.detail, result.detail
    earlier = CHECK_NAMES[: CHECK_NAMES.index(check)]
    unexpected = [n for n in earlier if not report.check(n).passed and n not in ALSO_FAILS.get(case, ())]
    assert unexpected == [], report.summary()


def test_slow_calls_fail_smoke_with_the_limit_named() -> None:
    code = mutate(GUESS_GAME, "self.turn += 1\n", "self.turn += 1\n        while True:\n            pass\n")
    report = check_env_source(code, "game", CheckConfig(call_time_limit_s=0.2))
    assert not report.check("smoke").passed
    assert "longer than the 0.2 s per-call limit" in report.check("smoke").detail


def test_import_time_work_is_limited() -> None:
    report = check_env_source("while True:\n    pass\n" + GUESS_GAME, "game", CheckConfig(call_time_limit_s=0.2))
    assert not report.check("structure").passed and "do no work at import" in report.check("structure").detail


def test_the_checker_leaves_the_global_rng_as_it_found_it() -> None:
    import random

    random.seed(99)
    state = random.getstate()
    check_env_source(mutate(GUESS_GAME, "self.rng.randint", "random.randint"), "game")
    assert random.getstate() == state


def test_bad_setting_is_the_callers_error() -> None:
    with pytest.raises(ValueError, match="setting must be 'game' or 'tool'"):
        check_env_source(GUESS_GAME, "board")


def test_progress_reports_each_check_as_it_starts_and_ends() -> None:
    events: list[tuple[str, dict | None]] = []
    report = check_env_source(GUESS_GAME, "game", progress=lambda name, result: events.append((name, result)))
    assert [name for name, _ in events] == [n for n in CHECK_NAMES for _ in range(2)]
    assert [r for _, r in events[1::2]] == [c.to_dict() for c in report.checks]
    assert all(r is None for _, r in events[0::2])


def test_total_budget_stops_a_slow_validation_with_a_finding() -> None:
    code = mutate(GUESS_GAME, "self.turn += 1\n", "self.turn += 1\n        sum(range(200_000))\n")
    report = check_env_source(code, "game", CheckConfig(total_time_limit_s=0.01))
    assert not report.valid
    assert any("budget of 0.01 s" in c.detail for c in report.failed), report.summary()


def test_env_code_calling_exit_is_a_finding_not_the_end_of_the_process() -> None:
    code = mutate(GUESS_GAME, "self.turn += 1\n", "self.turn += 1\n        raise SystemExit(3)\n")
    report = check_env_source(code, "game")
    assert not report.check("smoke").passed and "SystemExit: 3" in report.check("smoke").detail
    at_import = check_env_source("import sys\nsys.exit(1)\n" + GUESS_GAME, "game")
    assert "SystemExit" in at_import.check("structure").detail


def test_a_criterion_that_raises_does_not_hold() -> None:
    """`s["notes"][a]` raises until the note exists: that is "not yet", not an env crash."""
    lookup = mutate(NOTES_TOOL, 's["notes"].get(a) == {', 's["notes"][a] == {')
    assert check_env_source(lookup, "tool").valid
    broken = mutate(NOTES_TOOL, 's["notes"].get(a) == {', 's["missing"][a] == {')
    report = check_env_source(broken, "tool")
    assert "(it raised KeyError: 'missing')" in report.check("solution_replay").detail


def test_the_registry_names_every_check_in_pipeline_order_each_after_the_one_it_needs() -> None:
    assert list(CHECKS) == list(CHECK_NAMES)
    for name, check in CHECKS.items():
        assert check.name == name
        assert check.needs is None or CHECK_NAMES.index(check.needs) < CHECK_NAMES.index(name), name
    assert [n for n, c in CHECKS.items() if c.tool_only] == ["reset_gate", "irrelevant_action"]


def test_a_registered_check_runs_on_the_public_context_alone() -> None:
    """A check needs only what ``CheckContext`` offers: here the tool reset gate, on a broken env."""
    code = mutate(NOTES_TOOL, '{c: {"body": "old", "meta": {"tags": ["home"]}}}', "{}")
    ctx = CheckContext(code, Setting.TOOL, CheckConfig(), repairs=[])
    assert CHECKS["structure"].run(ctx).startswith("one env class NotesEnv (ToolEnv)")
    assert ctx.env_class is not None and ctx.env_class.__name__ == "NotesEnv"
    with pytest.raises(CheckFailed, match="already true right after reset"):
        CHECKS["reset_gate"].run(ctx)
    valid = CheckContext(NOTES_TOOL, Setting.TOOL, CheckConfig(), repairs=[])
    CHECKS["structure"].run(valid)
    assert CHECKS["solution_replay"].run(valid).startswith("solution() wins on every seed")
    assert sorted(valid.solutions) == sorted(valid.seeds)  # recorded for the later checks


# Any action wins on a "lucky" seed (one ending in 7) and none on another, so the tests choose the
# random policy's win count (only the structure and random_policy checks run on it).
LUCKY_GAME = mutate(
    mutate(
        mutate(
            GUESS_GAME,
            "        self.turn = 0\n        return",
            "        self.turn = 0\n        self.lucky = seed % 10 == 7\n        return",
        ),
        "    def step(self, action):\n",
        '    def step(self, action):\n        if self.lucky:\n            return "Lucky!", 1.0, True, False, {}\n',
    ),
    "elif int(match.group(1)) == self.secret:",
    "elif False:",
)


def _seeds(count: int, lucky: int, start: int) -> tuple[int, ...]:
    """``count`` distinct seeds from ``start`` on, the first ``lucky`` of them lucky."""
    return tuple([start + 10 * i + 7 for i in range(lucky)] + [start + 10 * i + 1 for i in range(lucky, count)])


def _random_policy_context(first: tuple[int, ...], more: tuple[int, ...]) -> tuple[CheckContext, list[int]]:
    ctx = CheckContext(LUCKY_GAME, Setting.GAME, CheckConfig(), repairs=[])
    CHECKS["structure"].run(ctx)
    ctx.random_seeds = first
    asked: list[int] = []

    def fresh_seeds(count: int) -> tuple[int, ...]:
        asked.append(count)
        return more[:count]

    ctx.fresh_seeds = fresh_seeds  # type: ignore[method-assign]
    return ctx, asked


def test_a_random_policy_over_the_limit_by_chance_is_confirmed_on_four_times_as_many_episodes() -> None:
    """4 wins of 20 (20%) is what a 4% guess reaches about once in 150 validations: 80 more episodes on
    fresh secret seeds decide, and 4 of 100 passes."""
    ctx, asked = _random_policy_context(_seeds(20, 4, 1000), _seeds(80, 0, 5000))
    assert CHECKS["random_policy"].run(ctx) == (
        "random/no-op policy won 4 of 100 episodes (4 of the first 20) (4%); limit 15%"
    )
    assert asked == [80]


def test_a_random_policy_that_keeps_winning_on_the_longer_count_fails() -> None:
    ctx, _ = _random_policy_context(_seeds(20, 4, 1000), _seeds(80, 12, 5000))
    with pytest.raises(CheckFailed, match=r"won 16 of 100 episodes \(4 of the first 20\) \(16%\).*trivial or hackable"):
        CHECKS["random_policy"].run(ctx)


def test_a_random_policy_under_the_limit_plays_no_more_episodes() -> None:
    ctx, asked = _random_policy_context(_seeds(20, 3, 1000), ())
    assert CHECKS["random_policy"].run(ctx) == "random/no-op policy won 3 of 20 episodes (15%); limit 15%"
    assert asked == []


def test_fresh_seeds_are_new_distinct_and_as_many_as_asked() -> None:
    ctx = CheckContext(GUESS_GAME, Setting.GAME, CheckConfig(), repairs=[])
    fresh = ctx.fresh_seeds(80)
    assert len(fresh) == len(set(fresh)) == 80
    assert not set(fresh) & {*ctx.seeds, *ctx.random_seeds}
