"""Plays through the real sandbox: the isolated pool in-process and the sandbox service over gRPC."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from services.memory.service import MemoryService
from services.memory.store.sql import SqlStore, make_engine, migrate
from services.rollout.memory import MemoryServicePlays
from services.rollout.policy import FormatterTemplate
from services.rollout.sandbox import PoolSessions
from services.rollout.state_store import RolloutStateStore
from services.rollout.worker import RolloutWorker, WorkerConfig
from services.sandbox.core.auth import hash_key
from services.sandbox.isolation import SandboxPool
from services.sandbox.isolation.settings import IsolationSettings
from spade.agent.episode import EpisodeRunner, PlayLimits
from spade.agent.ports import EnvSpec, SessionOpener
from spade.envs import CheckConfig, Setting, ToolCall
from spade.envs.examples import EXAMPLES, Example
from spade.envs.loader import load_env_class
from spade.envs.types import FinishReason
from spade.memory.records import NewEnvironment
from spade.queues.base import ENVS_READY, SAMPLES_AGENT
from spade.queues.config import InProcessQueueConfig
from spade.queues.inprocess import InProcessQueue
from spade.queues.messages import decode, publish_proto
from spade.runspec import RunSpec
from spade.sandbox.client import SandboxClient
from spade.v1 import queues_pb2, types_pb2
from tests.unit.rollout.players import ScriptedPolicy

ROLLOUT_KEY = "rollout-test-key"
PATIENT = CheckConfig(call_time_limit_s=30.0)
"""A per-call timer that a memory bomb on a loaded machine cannot outrun: it meets its memory limit first."""

# Win by saying the seed-chosen colour; the observation names it (the test is the plumbing).
COLOUR_ENV = r"""
import random

class ColourEnv:
    max_turns = 4

    def reset(self, seed=None):
        self.colour = random.Random(seed).choice(["red", "green", "blue"])
        self.turn = 0
        return f"Say the colour {self.colour} as \\boxed{{colour}}.", {}

    def step(self, action):
        self.turn += 1
        if action == "\\boxed{" + self.colour + "}":
            return "right", 1.0, True, False, {}
        if action == "\\boxed{crash}":
            raise RuntimeError("the env has a bug")
        return f"no, not {action}", 0.0, False, self.turn >= self.max_turns, {}

    def solution(self):
        return ["\\boxed{" + self.colour + "}"]
"""


# The colour env, but it declares more turns than any agent budget, and eats memory on \boxed{bomb}.
GREEDY_ENV = COLOUR_ENV.replace("max_turns = 4", "max_turns = 400").replace(
    '        if action == "\\\\boxed{crash}":',
    '        if action == "\\\\boxed{bomb}":\n'
    "            hog = []\n"
    "            while True:\n"
    "                hog.append(bytearray(64 << 20))\n"
    '        if action == "\\\\boxed{crash}":',
)


def _colour(seed: int) -> str:
    import random

    return random.Random(seed).choice(["red", "green", "blue"])


@pytest_asyncio.fixture(loop_scope="function")
async def pool() -> AsyncIterator[SandboxPool]:
    pool = SandboxPool(IsolationSettings.model_validate({"wall_seconds": 10.0}))
    await pool.start()
    try:
        yield pool
    finally:
        await pool.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def sandbox_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``spade serve sandbox`` as its own process on loopback, with a tenant key for the rollout."""
    grpc_port, http_port = _free_port(), _free_port()
    config = tmp_path_factory.mktemp("sandbox") / "sandbox.json"
    config.write_text(
        json.dumps(
            {
                "grpc": {"host": "127.0.0.1", "port": grpc_port},
                "http": {"host": "127.0.0.1", "port": http_port},
                "api_keys": [{"tenant": "rollout", "key_sha256": hash_key(ROLLOUT_KEY), "max_sessions": 16}],
                "checks": {"call_time_limit_s": PATIENT.call_time_limit_s},
            }
        )
    )
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.Popen([sys.executable, "-m", "spade.cli", "serve", "sandbox", "--config", str(config)], cwd=root)
    target = f"127.0.0.1:{grpc_port}"
    try:
        with grpc.insecure_channel(target) as channel:
            grpc.channel_ready_future(channel).result(timeout=120)
        yield target
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


SPEC = EnvSpec("colour", "game", "Pattern Recognition", COLOUR_ENV, hint="Read the observation.")


async def _plays(sessions: SessionOpener, template: FormatterTemplate) -> None:
    seed = 11
    colour = _colour(seed)
    runner = EpisodeRunner(
        sessions, ScriptedPolicy(template, ["\\boxed{purple}", f"It is \\boxed{{{colour}}}"]), template, PlayLimits()
    )
    won = await runner.play(SPEC, seed, hinted=True)
    assert (won.finish_reason, won.episode_return, won.turns) == (FinishReason.TERMINATED, 1.0, 2)

    crash = EpisodeRunner(sessions, ScriptedPolicy(template, ["\\boxed{crash}"]), template, PlayLimits())
    failed = await crash.play(SPEC, seed, hinted=False)
    assert (failed.finish_reason, failed.episode_return) == (FinishReason.ENV_ERROR, 0.0)

    stubborn = EpisodeRunner(sessions, ScriptedPolicy(template, ["\\boxed{purple}"]), template, PlayLimits())
    lost = await stubborn.play(SPEC, seed, hinted=False)
    assert (lost.finish_reason, lost.episode_return, lost.turns) == (FinishReason.TRUNCATED, 0.0, 4)

    # An env declaring 400 turns is clamped by the sandbox to the agent's budget of 3.
    greedy = EnvSpec("greedy", "game", "Pattern Recognition", GREEDY_ENV, hint="")
    budget = PlayLimits(max_turns=3)
    capped = await EpisodeRunner(sessions, ScriptedPolicy(template, ["\\boxed{purple}"]), template, budget).play(
        greedy, seed, hinted=False
    )
    assert (capped.finish_reason, capped.turns, capped.turn_cap) == (FinishReason.TURN_LIMIT, 3, 3)

    # A memory bomb ends the play as a memory fault: never "truncated", never a sandbox fault to retry.
    bomber = EpisodeRunner(sessions, ScriptedPolicy(template, ["\\boxed{bomb}"]), template, PlayLimits())
    bombed = await bomber.play(greedy, seed, hinted=False)
    assert (bombed.finish_reason, bombed.episode_return, bombed.turns) == (FinishReason.FAULT_MEMORY, 0.0, 1)


async def test_plays_in_the_isolated_pool(pool: SandboxPool, template: FormatterTemplate) -> None:
    await _plays(PoolSessions(pool, PATIENT), template)


async def test_plays_over_the_sandbox_grpc_play_stream(sandbox_target: str, template: FormatterTemplate) -> None:
    sessions = SandboxClient(sandbox_target, ROLLOUT_KEY)
    try:
        await _plays(sessions, template)
    finally:
        await sessions.close()


async def test_a_wrong_api_key_is_a_clear_error_not_a_retry(sandbox_target: str, template: FormatterTemplate) -> None:
    sessions = SandboxClient(sandbox_target, "not-the-key")
    try:
        with pytest.raises(RuntimeError, match="refused the session"):
            await sessions.open_session(COLOUR_ENV, "game", 1)
    finally:
        await sessions.close()


def _solution_replies(example: Example, seed: int) -> list[str]:
    """The example's own solution() for ``seed``, as agent replies (our trusted repo code, loaded here)."""
    loaded = load_env_class(example.code, example.setting)
    assert loaded.env_class is not None, loaded.problems
    env = loaded.env_class()
    env.reset(seed=seed)
    if example.setting is Setting.GAME:
        return [f"My move: {action}" for action in env.solution()]
    return ["\n".join(ToolCall.from_dict(dict(c)).to_text() for c in calls) for calls in env.solution()]


@pytest.mark.parametrize("name", sorted(EXAMPLES))
async def test_every_example_env_is_won_by_replaying_its_solution_through_the_pool(
    name: str, pool: SandboxPool, template: FormatterTemplate
) -> None:
    example = EXAMPLES[name]
    seed = 1234
    replies = _solution_replies(example, seed)
    spec = EnvSpec(name, example.setting.value, example.skill, example.code, example.hint)
    limits = PlayLimits(max_turns=len(replies), max_tokens_per_turn=1024, max_total_tokens=32_000)
    runner = EpisodeRunner(PoolSessions(pool), ScriptedPolicy(template, replies), template, limits)
    play = await runner.play(spec, seed, hinted=True)
    assert (play.finish_reason, play.episode_return, play.turns) == (FinishReason.TERMINATED, 1.0, len(replies))


async def test_a_memory_bomb_is_recorded_as_fault_memory_end_to_end(
    pool: SandboxPool, template: FormatterTemplate, tmp_path: Path
) -> None:
    """Sandbox -> rollout -> sample -> memory: the finish reason stays ``fault_memory`` all the way."""
    spec = RunSpec(group_size=2, window_versions_game=1, agent_max_turns=3, agent_max_tokens_per_turn=32)
    engine = make_engine(f"sqlite:///{tmp_path / 'memory.db'}")
    migrate(engine)
    memory = MemoryService(SqlStore(engine))
    queue = InProcessQueue(InProcessQueueConfig())
    store = RolloutStateStore.from_url(f"sqlite:///{tmp_path / 'rollout.db'}")
    try:
        put = await memory.put_environment(NewEnvironment(setting=Setting.GAME, skill="s", code=GREEDY_ENV, hint="h"))
        ready = queues_pb2.EnvReady(env_id=put.env_id, setting=types_pb2.SETTING_GAME, spec_id=spec.spec_id)
        await publish_proto(queue, ENVS_READY, ready, key=put.env_id)
        limits = PlayLimits(max_turns=spec.agent_max_turns, max_tokens_per_turn=spec.agent_max_tokens_per_turn)
        bomber = ScriptedPolicy(template, ["\\boxed{bomb}"])
        runner = EpisodeRunner(PoolSessions(pool, PATIENT), bomber, template, limits)
        # One bomb at a time: several together can exhaust the pool's total memory and stall on the wall clock.
        config = WorkerConfig("w", spec=spec, max_concurrent_plays=1)
        worker = RolloutWorker(queue, store, MemoryServicePlays(memory), runner, config)
        await worker.step_envs()
        assert await worker.step_window() >= 1
        got = await queue.consume(SAMPLES_AGENT, "learner", "l", count=100, block_ms=50)
        samples = [m for m in (decode(d) for d in got) if isinstance(m, queues_pb2.AgentSample)]
        assert len(samples) == 2 * 2
        ends = {(s.finish_reason, s.episode_return, s.turns) for s in samples}
        assert ends == {(types_pb2.FINISH_REASON_FAULT_MEMORY, 0.0, 1)}
        plays, _ = await memory.plays(put.env_id)
        assert {p.finish_reason for p in plays} == {"fault_memory"} and len(plays) == 2 * 2
        assert (await memory.get_environment(put.env_id)).stats.win_rate == 0.0  # the env failed the agent
    finally:
        store.dispose()
        await queue.close()
        engine.dispose()
