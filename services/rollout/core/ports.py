"""What the rollout core needs from the outside world, as small protocols and plain domain values.

Each protocol is implemented by an adapter (the sandbox pool or its gRPC client, the inference
client, the memory store or its gRPC client) and by nothing else in the core.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class StepResult(Protocol):
    """An env's answer to reset or step (``spade.envs.StepOutcome`` satisfies it)."""

    @property
    def observation(self) -> str: ...
    @property
    def reward(self) -> float: ...
    @property
    def terminated(self) -> bool: ...
    @property
    def truncated(self) -> bool: ...
    @property
    def info(self) -> Mapping[str, Any]: ...
    @property
    def outcome(self) -> Any: ...


class EnvSession(Protocol):
    """One live env instance in the sandbox; ``initial`` is ``reset(seed)``'s answer."""

    @property
    def initial(self) -> StepResult: ...

    async def step(self, action: str) -> StepResult: ...

    async def close(self) -> None: ...


class SessionOpener(Protocol):
    """Opens env sessions in the sandbox (the local pool or the gRPC client).

    ``agent_max_turns`` is the agent's turn budget: the session truncates there (outcome ``limit``)
    or earlier at the env's own ``max_turns``, which the sandbox clamps to the budget.
    """

    async def open_session(self, code: str, setting: str, seed: int, *, agent_max_turns: int = 0) -> EnvSession: ...


class Generated(Protocol):
    """One generation (``spade.inference.Generation`` satisfies it)."""

    @property
    def output_ids(self) -> Sequence[int]: ...
    @property
    def logprobs(self) -> Sequence[float]: ...
    @property
    def finish_reason(self) -> Any: ...
    @property
    def weight_version(self) -> int | None: ...


@dataclass(frozen=True)
class TurnSampling:
    """Sampling for one model turn.

    Attributes:
        max_new_tokens: Tokens this turn may generate (already capped by the play's budget).
        temperature: Sampling temperature.
        top_p: Nucleus mass.
        top_k: Top-k cut-off; -1 disables it.
        seed: SGLang's ``sampling_seed`` of this turn (``spade.inference.derive_sampling_seed``), so
            the same play gives the same tokens; None: unseeded.
    """

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int = -1
    seed: int | None = None


class Generator(Protocol):
    """Token-in/token-out generation against the current policy."""

    async def generate(self, input_ids: list[int], sampling: TurnSampling) -> Generated: ...


class ChatTemplate(Protocol):
    """The policy's chat template and tokenizer (the model's own, applied client-side)."""

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None,
        generation_prompt: bool,
    ) -> str:
        """Render messages to text with the model's template."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of already-rendered text (special-token markers become their ids)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` including special tokens (used to see which template closing was emitted)."""
        ...

    def decode_reply(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` without special tokens (what the model said, sent to the env)."""
        ...


@dataclass(frozen=True)
class EnvSpec:
    """What the memory holds about an env that the rollout needs to play it."""

    env_id: str
    setting: str
    skill: str
    code: str
    hint: str


class EnvNotFound(LookupError):
    """The memory has no env with the id ``envs.ready`` named (raised by ``EnvSource`` adapters)."""


class EnvSource(Protocol):
    """Reads envs from the memory (raises ``EnvNotFound`` for an unknown id)."""

    async def get_environment(self, env_id: str) -> EnvSpec: ...


@dataclass(frozen=True)
class Window:
    """An env's window as the memory stores it: slot 0 at ``start``, ``versions`` slots in all."""

    start: int
    versions: int


class WindowKeeper(Protocol):
    """Fixes an env's window in the memory (WAVE2 §3)."""

    async def set_window(self, env_id: str, window_start: int, window_versions: int) -> Window:
        """Store the window unless one is stored already (first writer wins); return the stored one."""
        ...


@dataclass(frozen=True)
class PlayRecord:
    """One finished play as the memory records it.

    Attributes:
        sample_id: Deterministic id of the play; also the ``AgentSample.sample_id`` (idempotency key).
        env_id: The env played.
        seed: The reset seed.
        hinted: Whether the hint was appended to the first observation.
        episode_return: The terminal reward (0 unless terminated).
        turns: Model turns taken.
        weight_version: Oldest weight version among the play's model tokens (the slot's version when
            it has none): what generated it, never what it is scored under.
        finish_reason: How the play ended (a ``spade.envs.types.FinishReason`` value).
        window_start: The env's window start (the memory's stored window).
        window_index: The window slot the play belongs to (0..k-1): what it is scored under.
        spec_id: The run spec it was played under.
    """

    sample_id: str
    env_id: str
    seed: int
    hinted: bool
    episode_return: float
    turns: int
    weight_version: int
    finish_reason: str
    window_start: int
    window_index: int
    spec_id: str


class PlayLog(Protocol):
    """Records plays and retirements in the memory."""

    async def record_plays(self, env_id: str, plays: Sequence[PlayRecord]) -> None:
        """Store plays; re-recording a ``sample_id`` must not duplicate it."""
        ...

    async def retire_environment(self, env_id: str, last_version: int, *, trivially_won: bool = False) -> None:
        """Mark the env's window closed (its designer sample can be scored); ``trivially_won``: its audit
        plays retired it (``core/audit.py``)."""
        ...


class RolloutMemory(EnvSource, WindowKeeper, PlayLog, Protocol):
    """Everything the worker needs from the memory: env code, windows, plays and retirements."""
