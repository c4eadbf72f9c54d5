"""The checks that only tool envs have: solution replay in instruction order, the reset gate and
irrelevant actions (DESIGN §4, §6). Each is a function over the public ``CheckContext``, registered
by name in ``spade.envs.checker.CHECKS``. Standard library only."""

from __future__ import annotations

from spade.envs.actions import ToolCall
from spade.envs.check_context import CheckContext
from spade.envs.findings import CheckFailed, short
from spade.envs.schema import example_value
from spade.envs.types import Outcome


def replay_tool_solution(ctx: CheckContext, seed: int) -> int:
    """Compute ``solution_calls()`` on one instance of ``seed``; replay it on a fresh one, in order.

    Returns:
        The turns the replay took.
    """
    blocks = ctx.solution_of(seed)
    session, _ = ctx.reset(seed)
    env = session.env
    ctx.check_turns(session, seed, sum(len(b) for b in blocks))
    outcome = session.last
    assert outcome is not None
    for i, block in enumerate(blocks):
        if session.guarded_call(env.criterion_holds, i):
            raise CheckFailed(
                f"seed {seed}: the criterion of instruction {i + 1} is already true when that instruction "
                "arrives, so no call can flip it; make it depend on a change the instruction asks for"
            )
        for k, call in enumerate(block):
            if env.current != i:
                raise CheckFailed(
                    f"seed {seed}: instruction {i + 1} completed after call {k} of its {len(block)} "
                    "solution calls; drop the extra calls or make the criterion require them"
                )
            outcome = session.step(call.to_text())
            if outcome.outcome is not Outcome.OK:
                raise CheckFailed(f"seed {seed}, instruction {i + 1}, call {call.name}: {outcome.observation}")
            result = (outcome.info.get("tool_results") or [{}])[0]
            if not result.get("ok", False):
                raise CheckFailed(
                    f"seed {seed}, instruction {i + 1}: solution call {call.name}({short(call.arguments, 80)}) "
                    f"failed: {short(result.get('output', ''))}"
                )
        if env.current != i + 1:
            raised = env.criterion_errors.get(i)
            raise CheckFailed(
                f"seed {seed}: after its {len(block)} solution calls, instruction {i + 1} "
                f"({short(env.instructions[i], 80)}) is not complete: its criterion did not go False->True"
                + (f" (it raised {raised})" if raised else "")
                + "; make solution() and the criterion agree"
            )
    if not (outcome.terminated and outcome.reward >= ctx.config.win_threshold):
        raise CheckFailed(
            f"seed {seed}: all instructions completed on a fresh instance (that never had solution() called) "
            "but the episode did not end with reward 1.0"
        )
    return outcome.turn


def check_reset_gate(ctx: CheckContext) -> str:
    for seed in ctx.seeds:
        session, _ = ctx.reset(seed)
        env = session.env
        for i, instruction in enumerate(env.instructions):
            if session.guarded_call(env.criterion_holds, i):
                raise CheckFailed(
                    f"seed {seed}: the criterion of instruction {i + 1} ({short(instruction, 80)}) is already "
                    "true right after reset(); it must be false until the agent's calls make it true"
                )
    return f"every criterion is false right after reset() on seeds {list(ctx.seeds)}"


def _advance_after(
    ctx: CheckContext, seed: int, prefix: list[ToolCall], calls: list[ToolCall], index: int
) -> bool | None:
    """Replay ``prefix`` then ``calls`` on a fresh instance; whether instruction ``index`` completed.

    None when the prefix did not bring the env to instruction ``index``.
    """
    session, _ = ctx.reset(seed)
    env = session.env
    for call in prefix:
        session.step(call.to_text())
    if env.current != index or session.done:
        return None
    for call in calls:
        outcome = session.step(call.to_text())
        if outcome.outcome in (Outcome.ENV_ERROR, Outcome.TIMEOUT):
            raise CheckFailed(f"seed {seed}, calling {call.name}: {outcome.observation}")
        if env.current > index:
            return True
        if outcome.done:
            break
    return False


def check_irrelevant_action(ctx: CheckContext) -> str:
    assert ctx.env_class is not None
    tools = ctx.env_class.tool_schemas()
    probes_run = 0
    for seed in ctx.seeds[:2]:
        blocks: list[list[ToolCall]] = ctx.solutions[seed]
        for i, block in enumerate(blocks):
            prefix = [c for b in blocks[:i] for c in b]
            own = {c.to_text() for c in block}
            used = {c.name for c in block}
            probes: list[ToolCall] = []
            for j, other in enumerate(blocks):
                probes += [c for c in other if j != i and c.to_text() not in own]
            probes += [ToolCall(n, example_value(t["parameters"])) for n, t in sorted(tools.items()) if n not in used]
            unique = {p.to_text(): p for p in probes}
            for probe in list(unique.values())[: ctx.config.max_irrelevant_probes]:
                probes_run += 1
                if _advance_after(ctx, seed, prefix, [probe], i):
                    raise CheckFailed(
                        f"seed {seed}: calling {probe.name}({short(probe.arguments, 80)}) while instruction "
                        f"{i + 1} ({short(blocks and _instruction(ctx, seed, i), 80)}) is open completes it, "
                        "but that call is not part of its solution; tie the criterion to the requested change"
                    )
            if len(block) > 1:
                for k, skipped in enumerate(block):
                    probes_run += 1
                    if _advance_after(ctx, seed, prefix, block[:k] + block[k + 1 :], i):
                        raise CheckFailed(
                            f"seed {seed}: skipping solution call {k + 1} ({skipped.name}) of instruction {i + 1} "
                            "still completes it; the criterion must require every step of the solution"
                        )
    return f"{probes_run} off-solution and skipped-step probes completed no instruction"


def _instruction(ctx: CheckContext, seed: int, index: int) -> str:
    session, _ = ctx.reset(seed)
    return str(session.env.instructions[index])
