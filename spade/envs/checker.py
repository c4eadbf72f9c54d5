"""The env checker: every validation check of DESIGN §4, each a named finding.

``check_env_source(code, setting, config)`` never raises on bad env code and never asserts: it
returns a ``ValidationReport`` with one ``CheckResult`` per name in ``CHECK_NAMES``, each saying
the rule, what was seen and the fix. Checks that cannot run because an earlier one failed are
reported as not passed, naming the check that blocked them. Standard library only. Where the env's
code runs is the ``runtime`` (``spade.envs.check_context``): in this process for trusted code
(tests); in the sandbox, every episode a check plays is a real session of its own, as a rollout's
play is (``spade.envs.remote``), so env code never shares a process with the checker that judges it
and cannot tell a check from a play.

Validation is indistinguishable from play: the seeds are drawn in secret for each run from the play
seed distribution (``CheckContext.seeds``), and ``solution()`` is computed on one instance and
replayed on a fresh instance of the same seed that never had ``solution()`` called.

Each check is a function over the public ``CheckContext`` (``spade.envs.check_context``), listed
by name in the registry ``CHECKS`` with the check it needs; the tool-only checks live in
``spade.envs.tool_checks``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from spade.envs import tool_checks
from spade.envs.actions import ToolCall
from spade.envs.check_context import CheckContext, EnvCheck, EnvRuntime
from spade.envs.findings import CheckFailed, short
from spade.envs.limits import CallTimeout, describe_exception
from spade.envs.parsing import parse
from spade.envs.policy import noop_action
from spade.envs.repair import repair_code
from spade.envs.schema import example_value
from spade.envs.session import EnvFault, EnvSession
from spade.envs.types import CHECK_NAMES, CheckConfig, CheckResult, Outcome, Setting, StepOutcome, ValidationReport

GAME_PROBES = ("\\boxed{1}", "\\boxed{test}", "hello")
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


def _failed_call(outcome: StepOutcome, what: str, ctx: CheckContext) -> CheckFailed:
    """The finding for a call whose session ended in a fault (timeout, error, a resource limit)."""
    if outcome.outcome is Outcome.TIMEOUT:
        return CheckFailed(
            f"{what} took longer than the {ctx.config.call_time_limit_s:g} s per-call limit "
            f"({short(outcome.observation)}); make it cheaper (no unbounded loops or huge searches)"
        )
    return CheckFailed(f"{what}: {outcome.observation}")


def _smoke_checked(ctx: CheckContext, session: EnvSession, outcome: StepOutcome, what: str) -> None:
    """Refuse a call whose answer is malformed, over the caps or out of range (what the env returned,
    before the session cut and clamped it)."""
    if outcome.outcome not in (Outcome.OK, Outcome.LIMIT):
        raise _failed_call(outcome, what, ctx)
    reward, chars = session.raw.get("reward", 0.0), session.raw.get("chars", 0)
    if not 0.0 <= reward <= 1.0:
        raise CheckFailed(
            f"{what} returned reward {reward}; rewards must lie in [0, 1] "
            "(1.0 for a win, 0 otherwise or partial credit)"
        )
    if chars > ctx.config.observation_cap:
        raise CheckFailed(f"{what} observation is {chars} chars, over the {ctx.config.observation_cap} cap")


def check_smoke(ctx: CheckContext) -> str:
    assert ctx.env_class is not None
    cls = ctx.env_class
    seed = ctx.seeds[0]
    session = ctx.session(seed)
    first = session.reset()
    _smoke_checked(ctx, session, first, f"reset(seed={seed})")
    if not first.observation.strip():
        raise CheckFailed(f"reset(seed={seed}) returned an empty observation; describe the task")
    if ctx.setting is Setting.TOOL and not first.info.get("tools"):
        raise CheckFailed("reset() info has no 'tools'; let ToolEnv.reset() build it")
    if ctx.setting is Setting.GAME:
        # The solution's first action, from another instance: solution() is never called on an
        # instance that is played.
        solution = ctx.try_solution(ctx.reset(seed)[0], seed)
        probes = [*GAME_PROBES]
        if isinstance(solution, list) and solution:
            probes.insert(0, solution[0])
    else:
        tools = cls.tool_schemas()
        probes = ["<tool_call>{not json</tool_call>", "Hello, how can I help?"]
        probes += [ToolCall(n, example_value(t["parameters"])).to_text() for n, t in sorted(tools.items())]
        probes.append(ToolCall("no_such_tool", {}).to_text())
    steps = 0
    outcome = first
    for probe in probes:
        if outcome.done:
            session = ctx.session(seed)
            outcome = session.reset()
            _smoke_checked(ctx, session, outcome, f"reset(seed={seed})")
        outcome = session.step(probe)
        _smoke_checked(ctx, session, outcome, f"step({short(probe, 60)}) on seed {seed}")
        steps += 1
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
    state = random.getstate() if ctx.runtime.shares_process else None
    try:
        for seed in ctx.seeds[:2]:
            session, _ = ctx.reset(seed)
            solution = ctx.try_solution(session, seed)
            actions = ctx.as_actions(solution)
            policy = ctx.policy(random.Random(ctx.rng.getrandbits(64)))
            actions = [*actions[:-1], *(policy.action("") for _ in range(3)), *actions[-1:]]
            global_a = ctx.rng.getrandbits(32)
            first, touched_a = _trace(ctx, seed, actions, global_seed=global_a)
            second, touched_b = _trace(ctx, seed, actions, global_seed=global_a ^ (1 + ctx.rng.getrandbits(31)))
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
        if state is not None:
            random.setstate(state)
    seeds = list(ctx.seeds[:2])
    return f"seeds {seeds}: {compared} identical steps across fresh instances; global RNG untouched"


def check_seed_variety(ctx: CheckContext) -> str:
    signatures: dict[int, list[Any]] = {}
    for seed in ctx.seeds:
        session, first = ctx.reset(seed)
        solution = ctx.try_solution(session, seed)
        signatures[seed] = [first.observation, repr(solution)]
        if ctx.setting is Setting.TOOL:
            signatures[seed].append(repr(session.env.state))
    # Hidden state shows in how each instance answers the same probe actions.
    probe_seed = ctx.rng.getrandbits(64)
    policy = ctx.policy(random.Random(probe_seed))
    for seed in ctx.seeds:
        session, outcome = ctx.reset(seed)
        policy.rng = random.Random(probe_seed)
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
            f"all {len(ctx.seeds)} seeds {list(ctx.seeds)} gave the same instance (same "
            "observation, solution and answers to probe actions): a memorisable instance. "
            "Build it from random.Random(seed)"
        )
    return f"{distinct} distinct instances across seeds {list(ctx.seeds)}"


def check_solution_replay(ctx: CheckContext) -> str:
    turns = []
    for seed in ctx.seeds:
        if ctx.setting is Setting.TOOL:
            turns.append(tool_checks.replay_tool_solution(ctx, seed))
        else:
            turns.append(_replay_game(ctx, seed))
    return (
        f"solution() wins on every seed {list(ctx.seeds)} in {min(turns)}-{max(turns)} turns, replayed on "
        f"fresh instances (the agent's budget is {ctx.config.max_turns_cap})"
    )


FRESH = "on a fresh instance that never had solution() called"
"""How every solution_replay finding says where the solution was replayed."""


def _replay_game(ctx: CheckContext, seed: int) -> int:
    actions = list(ctx.solution_of(seed))  # computed on one instance ...
    session, outcome = ctx.reset(seed)  # ... and replayed on another, as an agent would play it
    ctx.check_turns(session, seed, len(actions))
    for i, action in enumerate(actions):
        outcome = session.step(action)
        if outcome.outcome not in (Outcome.OK, Outcome.LIMIT):
            raise CheckFailed(f"replaying solution() {FRESH} of seed {seed}, action {i + 1}: {outcome.observation}")
        if outcome.done:
            break
    if outcome.terminated and outcome.reward >= ctx.config.win_threshold:
        return outcome.turn
    if outcome.done:
        how = "terminated" if outcome.terminated else f"truncated at turn {outcome.turn}/{session.max_turns}"
        raise CheckFailed(
            f"replaying solution() {FRESH} of seed {seed} did not win: {how} with reward {outcome.reward} "
            f"(last observation {short(outcome.observation)}); solution() must return the winning actions, "
            "and they must win on any instance of that seed"
        )
    raise CheckFailed(
        f"replaying all {len(actions)} solution() actions {FRESH} of seed {seed} did not end the episode "
        f"(last observation {short(outcome.observation)}); solution() must return the winning actions"
    )


#: When the random policy's first ``random_policy_episodes`` win more than the limit, it plays this many
#: times as many again on fresh secret seeds and the verdict is taken on all of them. Twenty episodes
#: alone rejected an env whose random guess wins 4% (counterfeit_coin) about once in 150 validations
#: (4 wins of 20), so a seed pool of several examples failed about once in 100 seedings; a trivial env
#: (a third of random plays winning, or more) fails the longer count as surely as the short one.
RANDOM_POLICY_CONFIRM_FACTOR = 4


def _random_policy_wins(ctx: CheckContext, seeds: Sequence[int], *, noop_first: bool) -> int:
    """Episodes of the random policy (the first a no-op one with ``noop_first``) won on ``seeds``."""
    rng = ctx.rng
    wins = 0
    for episode, seed in enumerate(seeds):
        session, outcome = ctx.reset(seed)
        policy = ctx.policy(rng, exclude_seed=seed)
        noop = noop_action(ctx.setting)
        while not outcome.done:
            action = noop if noop_first and episode == 0 else policy.action(outcome.observation)
            outcome = session.step(action)
            if outcome.outcome not in (Outcome.OK, Outcome.LIMIT):
                raise CheckFailed(
                    f"random play on seed {seed} broke the env after {short(action, 60)}: {outcome.observation}"
                )
        wins += outcome.terminated and outcome.reward >= ctx.config.win_threshold
    return wins


def check_random_policy(ctx: CheckContext) -> str:
    limit = ctx.config.random_policy_max_win_rate
    episodes = len(ctx.random_seeds)
    wins = _random_policy_wins(ctx, ctx.random_seeds, noop_first=True)
    confirmed = ""
    if wins / episodes > limit:  # over the limit by chance, or trivial: a longer count decides
        more = ctx.fresh_seeds(RANDOM_POLICY_CONFIRM_FACTOR * episodes)
        first = f" ({wins} of the first {episodes})"
        wins += _random_policy_wins(ctx, more, noop_first=False)
        episodes += len(more)
        confirmed = first
    rate = wins / episodes
    summary = f"random/no-op policy won {wins} of {episodes} episodes{confirmed} ({rate:.0%}); limit {limit:.0%}"
    if rate > limit:
        raise CheckFailed(
            summary + ": the reward is trivial or hackable; make winning depend on working out hidden state"
        )
    return summary


def check_termination(ctx: CheckContext) -> str:
    session, _ = ctx.reset(ctx.seeds[0])
    try:
        declared = session.guarded_call(lambda: session.env.max_turns)
    except EnvFault:
        declared = None
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
    for seed in ctx.seeds[:2]:
        for policy_name in ("no-op", "random"):
            session, outcome = ctx.reset(seed)
            policy = ctx.policy(random.Random(ctx.rng.getrandbits(64)), exclude_seed=seed)
            while not outcome.done:
                action = noop_action(ctx.setting) if policy_name == "no-op" else policy.action(outcome.observation)
                outcome = session.step(action)
                if outcome.outcome not in (Outcome.OK, Outcome.LIMIT):
                    raise _failed_call(outcome, f"step() on seed {seed}", ctx)
            if outcome.outcome is Outcome.LIMIT:  # the framework cut it: the env itself did not end it
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
    if not ctx.runtime.shares_process:
        results = run_checks(ctx, progress)
    else:
        rng_state = random.getstate()
        try:
            results = run_checks(ctx, progress)
        finally:  # Env code (or the determinism probe) used this process's global RNG: leave it as found.
            random.setstate(rng_state)
    return ValidationReport(
        valid=all(r.passed for r in results),
        setting=parsed.value,
        env_class=ctx.env_class.__name__ if ctx.env_class is not None else "",
        checks=results,
        repaired_code=repaired,
        duration_ms=(time.monotonic() - started) * 1000.0,
    )
