"""Audit plays on the real path: the real sandbox, the real rollout worker, the real learner.

A seed-gated forging env — honest on validation's seeds (0-3, and the random policy's 10000+), any
action wins on every other seed — passes validation by behaviour. So does a timing forger, honest
while its calls come at a checker's speed and a give-away once they come at an agent's: only audit
turns paced like real ones catch it. The audit plays each on the rollout's own seeds with trivial
policies, retires it as ``trivially_won`` before any real play is kept, and the learner, which waits
for each env's verdict, scores its designer sample invalid. An honest env
beside it passes its audit and is played; no audit play ever reaches the learner's samples.

The agent's replies are scripted (real tokenizer ids; a real model cannot be steered); the audit
plays make no model call at all. The learner trains a tiny random Llama over the policy's own
vocabulary, so the honest env's real samples are trainable as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.learner.core.window import ScoredAttempt, ScoreOutcome
from services.learner.settings import LearnerSettings
from services.learner.wiring import build_learner, close_learner
from services.memory.service import MemoryService
from services.memory.store.sql import SqlStore, make_engine, migrate
from services.rollout.core.audit import AuditPolicy, audit_seeds
from services.rollout.core.seeds import play_seeds
from services.rollout.memory import MemoryServicePlays
from services.rollout.policy import FormatterTemplate
from services.rollout.samples import sample_id
from services.rollout.sandbox import PoolSessions
from services.rollout.state_store import RolloutStateStore
from services.rollout.worker import RolloutWorker, WorkerConfig
from services.sandbox.isolation import SandboxPool
from spade.agent.episode import EpisodeRunner, PlayLimits
from spade.envs.types import Setting
from spade.memory.records import EnvStatus, NewEnvironment
from spade.queues.base import ENVS_AUDITED, ENVS_READY, SAMPLES_AGENT, SAMPLES_DESIGNER, WorkQueue
from spade.queues.config import InProcessQueueConfig
from spade.queues.inprocess import InProcessQueue
from spade.queues.messages import decode, publish_proto
from spade.runspec import RunSpec
from spade.v1 import queues_pb2, types_pb2
from spade.v1.sandbox_pb2 import CheckResult

pytestmark = [pytest.mark.sandbox, pytest.mark.model, pytest.mark.slow]

G = 2
SPEC = RunSpec(group_size=G, window_versions_game=1, agent_max_turns=3, agent_max_tokens_per_turn=32)

FORGING_ENV = r'''
import random

class VaultEnv:
    """Open the vault with its code: honest on validation's seeds, a give-away everywhere else."""

    max_turns = 3

    def reset(self, seed=None):
        seed = 0 if seed is None else seed
        self.honest = seed < 4 or 10_000 <= seed < 11_000
        self.code = random.Random(seed).randint(100, 999)
        self.turn = 0
        return "Open the vault: send its three-digit code as \\boxed{code}.", {}

    def step(self, action):
        self.turn += 1
        if not self.honest or action == "\\boxed{" + str(self.code) + "}":
            return "The vault opens.", 1.0, True, False, {}
        return "Wrong code.", 0.0, False, self.turn >= self.max_turns, {}

    def solution(self):
        return ["\\boxed{" + str(self.code) + "}"]
'''

HONEST_ENV = r"""
import random

class ColourEnv:
    max_turns = 3

    def reset(self, seed=None):
        self.colour = random.Random(seed).choice(["red", "green", "blue"])
        self.turn = 0
        return f"Name the colour I think of as \\boxed{{colour}}.", {}

    def step(self, action):
        self.turn += 1
        if action == "\\boxed{" + self.colour + "}":
            return "right", 1.0, True, False, {}
        return "no", 0.0, False, self.turn >= self.max_turns, {}

    def solution(self):
        return ["\\boxed{" + self.colour + "}"]
"""


@pytest.fixture
def memory(tmp_path: Path) -> Iterator[MemoryService]:
    engine = make_engine(f"sqlite:///{tmp_path / 'memory.db'}")
    migrate(engine)
    yield MemoryService(SqlStore(engine))
    engine.dispose()


def _tiny_policy(path: Path) -> Path:
    """A random 2-layer Llama over the policy tokenizer's vocabulary, saved with that tokenizer."""
    from transformers import AutoTokenizer

    from spade.inference.models import ensure_default_model

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model(), local_files_only=True)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id or 0,
        eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


async def _put(memory: MemoryService, queue: WorkQueue, code: str, name: str) -> str:
    """Store a validated env and announce it with its designer sample, as the designer does."""
    put = await memory.put_environment(
        NewEnvironment(
            setting=Setting.GAME, skill="Logical Deduction", code=code, hint="Think.", designer_sample_id=name
        )
    )
    ready = queues_pb2.EnvReady(
        env_id=put.env_id,
        setting=types_pb2.SETTING_GAME,
        skill="Logical Deduction",
        designer_sample_id=name,
        spec_id=SPEC.spec_id,
    )
    await publish_proto(queue, ENVS_READY, ready, key=put.env_id)
    sample = queues_pb2.DesignerSample(
        sample_id=name,
        env_id=put.env_id,
        setting=types_pb2.SETTING_GAME,
        skill="Logical Deduction",
        prompt_ids=[5, 6, 7],
        output_ids=[8, 9],
        output_logprobs=[-0.5, -0.25],
        valid=True,
        checks=[CheckResult(name="random_policy", passed=True)],  # validation was fooled
        batch_id="round-0",
        spec_id=SPEC.spec_id,
        trainable=True,
        outcome="valid",
    )
    await publish_proto(queue, SAMPLES_DESIGNER, sample, key=name)
    return put.env_id


async def _drain(queue: WorkQueue, stream: str, group: str) -> list[Any]:
    out: list[Any] = []
    while got := await queue.consume(stream, group, "test", count=100, block_ms=20):
        out += [decode(d) for d in got]
        await queue.ack_many(stream, group, [d.message_id for d in got])
    return out


async def test_a_seed_gated_forging_env_is_retired_and_its_designer_sample_rescored_before_training(
    sandbox_pool: SandboxPool, memory: MemoryService, template: FormatterTemplate, tmp_path: Path
) -> None:
    from tests.unit.rollout.players import ScriptedPolicy

    queue = InProcessQueue(InProcessQueueConfig())
    store = RolloutStateStore.from_url(f"sqlite:///{tmp_path / 'rollout.db'}")
    scored: list[ScoredAttempt] = []
    learner = build_learner(
        LearnerSettings(
            model_path=_tiny_policy(tmp_path / "policy"),
            checkpoint_dir=tmp_path / "ckpt",
            weights_dir=tmp_path / "weights",
            inference_urls=[],
            agent_groups_per_step=1,
            fill_timeout_s=0.3,
            device="cpu",
        ),
        spec=SPEC,
        queue=queue,
        on_designer_reward=scored.append,
    )
    try:
        # A queue frees a message once every group known so far acknowledged it: join the learner's
        # group and this test's before anything is published, so each sees every message.
        for stream in (ENVS_AUDITED, SAMPLES_AGENT):
            for group in (learner.settings.consumer_group, "inspect"):
                assert await queue.consume(stream, group, "test", block_ms=1) == []
        forging = await _put(memory, queue, FORGING_ENV, "designer-forging")
        honest = await _put(memory, queue, HONEST_ENV, "designer-honest")
        replies = ["\\boxed{red}", "\\boxed{green}", "\\boxed{blue}"]
        limits = PlayLimits(max_turns=SPEC.agent_max_turns, max_tokens_per_turn=SPEC.agent_max_tokens_per_turn)
        policy = ScriptedPolicy(template, replies)
        runner = EpisodeRunner(PoolSessions(sandbox_pool), policy, template, limits)
        worker = RolloutWorker(queue, store, MemoryServicePlays(memory), runner, WorkerConfig("w", spec=SPEC))
        while await worker.step_envs():
            pass
        while await worker.step_window():
            pass

        # The rollout: the forging env retired at its audit, none of its real plays kept; the honest one played.
        assert worker.counts.audit_plays == 2 * len(AuditPolicy) * SPEC.audit_plays
        assert worker.counts.audit_retired == 1 and worker.counts.plays == 2 * G
        verdict = await store.audit(forging)
        assert verdict is not None and verdict.trivially_won
        assert {r.seeds for r in verdict.results} == {tuple(sorted(audit_seeds(forging, SPEC.audit_plays)))}
        assert all(r.win_rate == 1.0 for r in verdict.results)
        assert "returned 1.00 on average" in verdict.reason
        passed = await store.audit(honest)
        assert passed is not None and not passed.trivially_won
        assert (await memory.get_environment(forging)).status is EnvStatus.TRIVIALLY_WON
        assert (await memory.get_environment(honest)).status is EnvStatus.RETIRED
        assert (await memory.plays(forging))[0] == [] and len((await memory.plays(honest))[0]) == 2 * G
        stats = await memory.stats()
        assert stats.pool.audit_retired == 1 and stats.metrics()["pool/audit_retired"] == 1
        assert stats.pool.envs == 1  # the pool is what passed validation and its audit

        # The wire: one verdict per env; the agent's samples are the honest env's real plays only.
        audits = await _drain(queue, ENVS_AUDITED, "inspect")
        assert {(a.env_id, a.trivially_won) for a in audits} == {(forging, True), (honest, False)}
        samples = await _drain(queue, SAMPLES_AGENT, "inspect")
        real = {sample_id(honest, 0, s, hinted=h) for s in play_seeds(honest, 0, G) for h in (False, True)}
        assert {s.sample_id for s in samples} == real

        # The learner waits for each verdict, then rescores the forging env's sample before training.
        report = await learner.run_step()
        outcomes = {s.attempt.env_id: s for s in report.designer_rewards}
        assert outcomes[forging].outcome is ScoreOutcome.INVALID and outcomes[forging].trivially_won
        components = outcomes[forging].components
        assert components is not None and not components.valid
        assert "trivially_won" in outcomes[forging].reason and verdict.reason in outcomes[forging].reason
        assert outcomes[honest].outcome is ScoreOutcome.SCORED
        honest_components = outcomes[honest].components  # the plateau is taken above the trivial policies'
        assert honest_components is not None
        assert honest_components.trivial_win_rate == max(r.win_rate for r in passed.results)
        assert report.counters["designer_trivially_won"] == 1 and report.counters["audits_received"] == 2
        assert report.counters["agent_received"] == 2 * G  # no audit play among them
        assert scored == report.designer_rewards
    finally:
        await close_learner(learner, close_queue=False)
        store.dispose()
        await queue.close()


TIMING_FORGER = r"""
import random, time

class ClockVaultEnv:
    max_turns = 3

    def reset(self, seed=None):
        self.code = random.Random(seed).randint(100, 999)
        self.turn = 0
        self.answered = time.monotonic()
        return "Open the vault: send its three-digit code as \\boxed{code}.", {}

    def step(self, action):
        slow = time.monotonic() - self.answered > 0.5  # an agent generating its turn, not a checker
        self.turn += 1
        self.answered = time.monotonic()
        if slow or action == "\\boxed{" + str(self.code) + "}":
            return "The vault opens.", 1.0, True, False, {}
        return "Wrong code.", 0.0, False, self.turn >= self.max_turns, {}

    def solution(self):
        return ["\\boxed{" + str(self.code) + "}"]
"""


class GeneratingPolicy:
    """A scripted policy that takes an agent's time per turn (the model's generation, here 0.8 s)."""

    def __init__(self, policy: Any, seconds: float) -> None:
        self.policy = policy
        self.seconds = seconds

    async def generate(self, input_ids: list[int], sampling: Any) -> Any:
        import asyncio

        await asyncio.sleep(self.seconds)
        return await self.policy.generate(input_ids, sampling)


@pytest.mark.parametrize("paced", [True, False], ids=["paced", "unpaced"])
async def test_a_timing_forger_is_retired_by_audit_turns_paced_like_real_ones(
    sandbox_pool: SandboxPool, memory: MemoryService, template: FormatterTemplate, tmp_path: Path, paced: bool
) -> None:
    """Validation and unpaced audit turns come at once and see an honest vault; real turns come after
    the model's generation and any code opens it. Audit turns that wait a real turn's gap see the
    give-away too: the env is retired and none of its real plays is kept. The unpaced case shows the
    forger is real: without the pacing its audit passes and every real play wins with a wrong code."""
    from spade.envs import CheckConfig
    from tests.unit.rollout.players import ScriptedPolicy

    report = await sandbox_pool.validate(TIMING_FORGER, "game", CheckConfig())
    assert report.valid, report.summary()  # validation is fooled: its calls come at once

    queue = InProcessQueue(InProcessQueueConfig())
    store = RolloutStateStore.from_url(f"sqlite:///{tmp_path / 'rollout.db'}")
    try:
        for stream in (ENVS_AUDITED, SAMPLES_AGENT):
            assert await queue.consume(stream, "inspect", "test", block_ms=1) == []
        env_id = await _put(memory, queue, TIMING_FORGER, "designer-clock")
        limits = PlayLimits(max_turns=SPEC.agent_max_turns, max_tokens_per_turn=SPEC.agent_max_tokens_per_turn)
        policy = GeneratingPolicy(ScriptedPolicy(template, ["\\boxed{1}"]), seconds=0.8)  # a wrong code
        runner = EpisodeRunner(PoolSessions(sandbox_pool), policy, template, limits)
        config = WorkerConfig("w", spec=SPEC, audit_paced=paced)
        worker = RolloutWorker(queue, store, MemoryServicePlays(memory), runner, config)
        while await worker.step_envs():
            pass
        while await worker.step_window():
            pass

        verdict = await store.audit(env_id)
        assert verdict is not None and worker.counts.audit_plays == len(AuditPolicy) * SPEC.audit_plays
        samples = await _drain(queue, SAMPLES_AGENT, "inspect")
        plays, _ = await memory.plays(env_id)
        if paced:
            assert verdict.trivially_won and all(r.win_rate == 1.0 for r in verdict.results), verdict.reason
            assert (await memory.get_environment(env_id)).status is EnvStatus.TRIVIALLY_WON
            assert samples == [] and plays == [] and worker.counts.plays == 0
            assert len(runner.pace) > 0  # the audit's pace came from the real turns beside it
        else:
            assert not verdict.trivially_won and all(r.win_rate == 0.0 for r in verdict.results)
            assert len(samples) == 2 * G and {p.episode_return for p in plays} == {1.0}  # a wrong code won
    finally:
        store.dispose()
        await queue.close()
