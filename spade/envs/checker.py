"""The env checker: every validation check of DESIGN §4, each a named finding.

``check_env_source(code, setting, config)`` never raises on bad env code and never asserts: it
returns a ``ValidationReport`` with one ``CheckResult`` per name in ``CHECK_NAMES``, each saying
the rule, what was seen and the fix. Checks that cannot run because an earlier one failed are
reported as not passed, naming the check that blocked them. Standard library only. Where the env's
code runs is the ``runtime`` (``spade.envs.check_context``): in this process for trusted code
(tests), in a separate host process in the sandbox, so that env code never shares a process with
the checker that judges it (``spade.envs.remote``).

Each check is a function over the public ``CheckContext`` (``spade.envs.check_context``), listed
by name in the registry ``CHECKS`` with the check it needs; the tool-only checks live in
``spade.envs.tool_checks``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from functools import partial
from types import MappingProxyType
from typing import Any

from spade.envs import tool_checks
from spade.envs.actions import ToolCall, normalize_game_action
from spade.envs.check_context import CheckContext, EnvCheck, EnvRuntime
from spade.envs.contract import ContractError, unpack_reset, unpack_step
from spade.envs.findings import CheckFailed, short
from spade.envs.limits import CallTimeout, describe_exception
from spade.envs.parsing import parse
from spade.envs.policy import noop_action
from spade.envs.repair import repair_code
from spade.envs.schema import example_value
from spade.envs.session import EnvFault, EnvSession
from spade.envs.types import CHECK_NAMES, CheckConfig, CheckResult, Outcome, Setting, ValidationReport

GAME_PROBES = ("\\boxed{1}", "\\boxed{test}", "hello")
RANDOM_POLICY_SEED_BASE = 10_000
Progress = Callable[[str, "dict[str, Any] | None"], None]
"""Called with ``(check_name, None)`` when a check starts and ``(check_name, result.to_dict())`` when
it ends (the sandbox streams these)."""


def check_syntax(ctx: CheckContext) -> str:
    try:
        parse(ctx.code)
    except SyntaxError as exc:
        raise CheckFailed(
            f"line {exc.lineno}: {exc.msg} (after the known repairs"
            + (f": {'; '.join(ctx.repairs)}" if ctx.repairs else "")
            + "); fix the code so it parses"
        ) from None
    return "parses" + (f" after repairs: {'; '.join(ctx.repairs)}" if ctx.repairs else "")


def check_structure(ctx: CheckContext) -> str:
    try:
        loaded = ctx.runtime.load(ctx.code, ctx.setting, ctx.config)
    except CallTimeout:
        raise CheckFailed(
            f"running the module took longer than {ctx.config.call_time_limit_s:g} s; do no work at import"
        ) from None
    if loaded.env_class is not None:
        ctx.env_class = loaded.env_class
    if not loaded.ok:
        raise CheckFailed("; ".join(loaded.problems))
    assert ctx.env_class is not None
    if ctx.setting is Setting.TOOL:
        tools = ctx.env_class.tool_schemas()
        return f"one env class {ctx.env_class.__name__} (ToolEnv) with {len(tools)} tools: {', '.join(tools)}"
    return f"one env class {ctx.env_class.__name__} with reset/step/solution"


def check_smoke(ctx: CheckContext) -> str:
    assert ctx.env_class is not None
    cls = ctx.env_class
    cap = ctx.config.observation_cap
    seed = ctx.config.seeds[0]
    env = ctx.guarded(cls, f"{cls.__name__}()")
    try:
        observation, info = unpack_reset(ctx.guarded(partial(env.reset, seed=seed), f"reset(seed={seed})"))
    except ContractError as exc:
        raise CheckFailed(f"{exc}; return (observation, info) from reset()") from None
    if not observation.strip():
        raise CheckFailed(f"reset(seed={seed}) returned an empty observation; describe the task")
    if len(observation) > cap:
        raise CheckFailed(f"reset(seed={seed}) observation is {len(observation)} chars, over the {cap} cap")
    if ctx.setting is Setting.TOOL and not info.get("tools"):
        raise CheckFailed("reset() info has no 'tools'; let ToolEnv.reset() build it")
    if ctx.setting is Setting.GAME:
        try:
            first = ctx.guarded(env.solution, f"solution() on seed {seed}")
        except CheckFailed:  # solution_replay reports it
            first = None
        probes = [*GAME_PROBES]
        if isinstance(first, list | tuple) and first and isinstance(first[0], str):
            probes.insert(0, first[0])
    else:
        tools = cls.tool_schemas()
        probes = ["<tool_call>{not json</tool_call>", "Hello, how can I help?"]
        probes += [ToolCall(n, example_value(t["parameters"])).to_text() for n, t in sorted(tools.items())]
        probes.append(ToolCall("no_such_tool", {}).to_text())
    steps = 0
    for probe in probes:
        action = normalize_game_action(probe) if ctx.setting is Setting.GAME else probe
        try:
            raw = ctx.guarded(partial(env.step, action), f"step({short(action, 60)}) on seed {seed}")
            observation, reward, terminated, truncated, _ = unpack_step(raw)
        except ContractError as exc:
            raise CheckFailed(f"step({short(action, 60)}): {exc}") from None
        if not 0.0 <= reward <= 1.0:
            raise CheckFailed(
                f"step({short(action, 60)}) returned reward {reward}; rewards must lie in [0, 1] "
                "(1.0 for a win, 0 otherwise or partial credit)"
            )
        if len(observation) > cap:
            raise CheckFailed(f"step() observation is {len(observation)} chars, over the {cap} cap")
        steps += 1
        if terminated or truncated:
            env = ctx.guarded(cls, f"{cls.__name__}()")
            try:
                ctx.guarded(partial(env.reset, seed=seed), f"reset(seed={seed})")
            except ContractError as exc:
                raise CheckFailed(f"{exc}; return (observation, info) from reset()") from None
    return f"reset(seed={seed}) and {steps} probe steps returned well-formed values within the time limit"


def _trace(ctx: CheckContext, seed: int, actions: list[str], global_seed: int) -> tuple[list[Any], bool]:
    """Play ``actions`` on a fresh instance with the env process's global RNG seeded to ``global_seed``.

    Returns the trace of (observation, reward, terminated, truncated) and whether any env call
    changed the global RNG's state.
    """
    ctx.runtime.seed_global(global_seed)
    mark = ctx.runtime.rng_mark()
    session = ctx.session(seed)
    outcome = session.reset()
    trace: list[Any] = [("reset", outcome.observation, outcome.outcome.value)]
    for action in actions:
        if outcome.done:
            break
        outcome = session.step(action)
        trace.append((outcome.observation, outcome.reward, outcome.terminated, outcome.truncated))
    return trace, ctx.runtime.rng_touched(mark)


def check_determinism(ctx: CheckContext) -> str:
    compared = 0
    state = random.getstate()
    try:
        for seed in ctx.config.seeds[:2]:
            session, _ = ctx.reset(seed)
            solution = ctx.try_solution(session, seed)
            actions = ctx.as_actions(solution)
            policy = ctx.policy(random.Random(ctx.config.random_policy_seed + seed))
            actions = [*actions[:-1], *(policy.action("") for _ in range(3)), *actions[-1:]]
            first, touched_a = _trace(ctx, seed, actions, global_seed=1)
            second, touched_b = _trace(ctx, seed, actions, global_seed=2)
            if touched_a or touched_b:
                raise CheckFailed(
                    f"on seed {seed}, reset()/step() used the global random module (its state changed); "
                    "draw all randomness from an instance-local rng = random.Random(seed) made in reset()"
                )
            for i, (a, b) in enumerate(zip(first, second, strict=False)):
                if a != b:
                    where = "reset()" if i == 0 else f"step {i}"
                    raise CheckFailed(
                        f"seed {seed} with the same actions gave different results at {where}: "
                        f"{short(a[0] if i else a[1])} vs {short(b[0] if i else b[1])}; the same seed "
                        "and actions must give the same observations (no time, global RNG or unseeded "
                        "random.Random())"
                    )
            if len(first) != len(second):
                raise CheckFailed(f"seed {seed} with the same actions ended after different numbers of steps")
            compared += len(first)
            again = ctx.try_solution(ctx.reset(seed)[0], seed)
            if repr(again) != repr(solution):
                raise CheckFailed(f"solution() differs between two reset(seed={seed}) calls; derive it from the seed")
    finally:
        random.setstate(state)
    seeds = list(ctx.config.seeds[:2])
    return f"seeds {seeds}: {compared} identical steps across fresh instances; global RNG untouched"


def check_seed_variety(ctx: CheckContext) -> str:
    signatures: dict[int, list[Any]] = {}
    for seed in ctx.config.seeds:
        session, first = ctx.reset(seed)
        solution = ctx.try_solution(session, seed)
        signatures[seed] = [first.observation, repr(solution)]
        if ctx.setting is Setting.TOOL:
            signatures[seed].append(repr(session.env.state))
    # Hidden state shows in how each instance answers the same probe actions.
    policy = ctx.policy(random.Random(0))
    for seed in ctx.config.seeds:
        session, outcome = ctx.reset(seed)
        policy.rng = random.Random(ctx.config.random_policy_seed)
        for _ in range(3):
            if outcome.done:
                break
            outcome = session.step(policy.action(outcome.observation))
            signatures[seed].append(outcome.observation)
    distinct = len({repr(s) for s in signatures.values()})
    if distinct == 1:
        if all(s[1] == "None" for s in signatures.values()):
            return "inconclusive: solution() failed (see solution_replay) and observations match across seeds"
        raise CheckFailed(
            f"all {len(ctx.config.seeds)} seeds {list(ctx.config.seeds)} gave the same instance (same "
            "observation, solution and answers to probe actions): a memorisable instance. "
            "Build it from random.Random(seed)"
        )
    return f"{distinct} distinct instances across seeds {list(ctx.config.seeds)}"


def check_solution_replay(ctx: CheckContext) -> str:
    turns = []
    for seed in ctx.config.seeds:
        session, _ = ctx.reset(seed)
        if ctx.setting is Setting.TOOL:
            turns.append(tool_checks.replay_tool_solution(ctx, session, seed))
        else:
            turns.append(_replay_game(ctx, session, seed))
    return (
        f"solution() wins on every seed {list(ctx.config.seeds)} in {min(turns)}-{max(turns)} turns "
        f"(the agent's budget is {ctx.config.max_turns_cap})"
    )


def _replay_game(ctx: CheckContext, session: EnvSession, seed: int) -> int:
    actions = ctx.solution(session, seed)
    outcome = session.last
    assert outcome is not None
    ctx.check_turns(session, seed, len(actions))
    for i, action in enumerate(actions):
        outcome = session.step(action)
        if outcome.outcome in (Outcome.ENV_ERROR, Outcome.TIMEOUT):
            raise CheckFailed(f"replaying solution() on seed {seed}, action {i + 1}: {outcome.observation}")
        if outcome.done:
            break
    if outcome.terminated and outcome.reward >= ctx.config.win_threshold:
        return outcome.turn
    if outcome.done:
        how = "terminated" if outcome.terminated else f"truncated at turn {outcome.turn}/{session.max_turns}"
        raise CheckFailed(
            f"replaying solution() on seed {seed} did not win: {how} with reward {outcome.reward} "
            f"(last observation {short(outcome.observation)}); solution() must return the winning actions"
        )
    raise CheckFailed(
        f"replaying all {len(actions)} solution() actions on seed {seed} did not end the episode "
        f"(last observation {short(outcome.observation)}); solution() must return the winning actions"
    )


def check_random_policy(ctx: CheckContext) -> str:
    rng = random.Random(ctx.config.random_policy_seed)
    episodes = ctx.config.random_policy_episodes
    wins = 0
    for episode in range(episodes):
        seed = RANDOM_POLICY_SEED_BASE + episode
        session, outcome = ctx.reset(seed)
        policy = ctx.policy(rng, exclude_seed=seed)
        noop = noop_action(ctx.setting)
        while not outcome.done:
            action = noop if episode == 0 else policy.action(outcome.observation)
            outcome = session.step(action)
            if outcome.outcome in (Outcome.ENV_ERROR, Outcome.TIMEOUT):
                raise CheckFailed(
                    f"random play on seed {seed} broke the env after {short(action, 60)}: {outcome.observation}"
                )
        wins += outcome.terminated and outcome.reward >= ctx.config.win_threshold
    rate = wins / episodes
    limit = ctx.config.random_policy_max_win_rate
    summary = f"random/no-op policy won {wins} of {episodes} episodes ({rate:.0%}); limit {limit:.0%}"
    if rate > limit:
        raise CheckFailed(
            summary + ": the reward is trivial or hackable; make winning depend on working out hidden state"
        )
    return summary


def check_termination(ctx: CheckContext) -> str:
    assert ctx.env_class is not None
    cls = ctx.env_class
    env = ctx.guarded(cls, f"{cls.__name__}()")
    declared = getattr(env, "max_turns", None)
    cap = ctx.config.max_turns_cap
    if declared is None:
        return f"declares no max_turns; sessions truncate at {ctx.config.effective_max_turns(None)} turns"
    if isinstance(declared, bool) or not isinstance(declared, int) or declared < 1:
        raise CheckFailed(f"max_turns must be a positive int, got {short(declared)}")
    if declared > cap:
        return (
            f"declares max_turns={declared}, more than the agent's budget of {cap} turns: clamped to {cap} "
            "(sessions truncate at that turn)"
        )
    for seed in ctx.config.seeds[:2]:
        for policy_name in ("no-op", "random"):
            env = ctx.guarded(cls, f"{cls.__name__}()")
            observation, _ = unpack_reset(ctx.guarded(partial(env.reset, seed=seed), f"reset(seed={seed})"))
            policy = ctx.policy(random.Random(seed), exclude_seed=seed)
            ended = False
            for _ in range(declared):
                action = noop_action(ctx.setting) if policy_name == "no-op" else policy.action(observation)
                if ctx.setting is Setting.GAME:
                    action = normalize_game_action(action)
                raw = ctx.guarded(partial(env.step, action), f"step() on seed {seed}")
                observation, _, terminated, truncated, _ = unpack_step(raw)
                if terminated or truncated:
                    ended = True
                    break
            if not ended:
                raise CheckFailed(
                    f"after max_turns={declared} steps of {policy_name} play on seed {seed} the env neither "
                    "terminated nor truncated; return truncated=True once the turn count reaches max_turns"
                )
    return f"episodes end within max_turns={declared} under no-op and random play"


CHECKS: Mapping[str, EnvCheck] = MappingProxyType(
    {
        check.name: check
        for check in (
            EnvCheck("syntax", check_syntax),
            EnvCheck("structure", check_structure, needs="syntax"),
            EnvCheck("smoke", check_smoke, needs="structure"),
            EnvCheck("determinism", check_determinism, needs="smoke"),
            EnvCheck("seed_variety", check_seed_variety, needs="smoke"),
            EnvCheck("solution_replay", check_solution_replay, needs="smoke"),
            EnvCheck("random_policy", check_random_policy, needs="smoke"),
            EnvCheck("termination", check_termination, needs="smoke"),
            EnvCheck("reset_gate", tool_checks.check_reset_gate, needs="smoke", tool_only=True),
            EnvCheck("irrelevant_action", tool_checks.check_irrelevant_action, needs="solution_replay", tool_only=True),
        )
    }
)
"""The registry: every check by name, in pipeline order (the order of ``CHECK_NAMES``)."""


def _blocker(name: str, results: Mapping[str, CheckResult]) -> str | None:
    """The failed check that keeps ``name`` from running: the root failure, not an also-blocked one."""
    dep = CHECKS[name].needs
    while dep is not None:
        if not results[dep].passed:
            root = CHECKS[dep].needs
            while root is not None and not results[root].passed:
                dep, root = root, CHECKS[root].needs
            return dep
        dep = CHECKS[dep].needs
    return None


def _run_one(check: EnvCheck, ctx: CheckContext, results: Mapping[str, CheckResult]) -> CheckResult:
    name = check.name
    if ctx.setting is Setting.GAME and check.tool_only:
        return CheckResult(name, True, "not applicable to game envs")
    blocker = _blocker(name, results)
    if blocker:
        return CheckResult(name, False, f"not run: blocked by the failed {blocker!r} check")
    if ctx.over_budget:
        budget = f"{ctx.config.total_time_limit_s:g} s"
        return CheckResult(name, False, f"not run: the validation budget of {budget} was used up")
    try:
        return CheckResult(name, True, check.run(ctx))
    except CheckFailed as exc:
        return CheckResult(name, False, str(exc))
    except EnvFault as fault:
        return CheckResult(name, False, f"env code failed: {fault.message}")
    except (Exception, SystemExit) as exc:  # The checker returns findings, whatever the env did.
        return CheckResult(name, False, f"the check could not run: {describe_exception(exc)}")


def run_checks(ctx: CheckContext, progress: Progress | None = None) -> list[CheckResult]:
    """Every registered check on ``ctx``, in order; one result per name in ``CHECK_NAMES``."""
    results: dict[str, CheckResult] = {}
    for name in CHECK_NAMES:
        if progress is not None:
            progress(name, None)
        results[name] = _run_one(CHECKS[name], ctx, results)
        if progress is not None:
            progress(name, results[name].to_dict())
    return [results[name] for name in CHECK_NAMES]


def check_env_source(
    code: str,
    setting: str | Setting,
    config: CheckConfig | None = None,
    *,
    progress: Progress | None = None,
    runtime: EnvRuntime | None = None,
) -> ValidationReport:
    """Validate env ``code`` for ``setting`` (``"game"`` or ``"tool"``); see the module docstring.

    Args:
        code: the env source (an LLM reply's code block; the known repairs are applied first).
        setting: ``"game"`` or ``"tool"``.
        config: limits and thresholds; ``CheckConfig()`` by default.
        progress: optional callback, ``progress(name, None)`` as each check starts and
            ``progress(name, result_dict)`` as it ends.
        runtime: where the env's code runs (``spade.envs.check_context``); in this process by
            default, which is only for trusted code.

    Returns:
        A ``ValidationReport`` whose ``checks`` has one entry per name in ``CHECK_NAMES``, in order.

    Raises:
        ValueError: only for a bad ``setting`` (the caller's mistake, not the env's).
    """
    started = time.monotonic()
    parsed = Setting.parse(setting)
    config = config or CheckConfig()
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    repaired, repairs = repair_code(code)
    ctx = CheckContext(repaired, parsed, config, repairs, runtime)
    rng_state = random.getstate()
    try:
        results = run_checks(ctx, progress)
    finally:  # Env code (or the determinism probe) may have used the global RNG: leave it as found.
        random.setstate(rng_state)
    return ValidationReport(
        valid=all(r.passed for r in results),
        setting=parsed.value,
        env_class=ctx.env_class.__name__ if ctx.env_class is not None else "",
        checks=results,
        repaired_code=repaired,
        duration_ms=(time.monotonic() - started) * 1000.0,
    )
