"""What the agent's episode loop needs from the outside world, as small protocols and plain values.

Each protocol is implemented by an adapter: a sandbox session (the pool's or the sandbox service's
client), the inference client, a chat template. The rollout and ``spade eval`` both play through them.
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
    """What playing an env needs: its code, setting, skill and privileged hint."""

    env_id: str
    setting: str
    skill: str
    code: str
    hint: str
