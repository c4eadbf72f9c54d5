"""Token-in/token-out trajectories: the exact ids the policy saw and sampled, with masks and logprobs.

A play is one growing token sequence. Model tokens are appended exactly as sampled (loss mask 1,
the rollout logprob of each); everything else — the prompt, env observations, tool results, the
template's turn markers — is appended as the *template delta* (mask 0, logprob 0): the text the
chat template adds when the new messages follow an assistant turn. Re-tokenising the whole
conversation each turn would silently change earlier model tokens (BPE merges across turn
boundaries, templates that rewrite history), so the sequence is only ever extended.

The delta is computed on a fixed probe conversation rather than the real history, so templates that
re-render earlier turns (thinking models dropping old reasoning) do not break the prefix property.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from spade.agent.ports import ChatTemplate

_PROBE_USER = "spade-probe-user"
_PROBE_ASSISTANT = "spade-probe-assistant"


class TemplateError(ValueError):
    """The chat template does not extend conversations by appending (token deltas are impossible)."""


@dataclass
class Trajectory:
    """The sequence a learner trains on.

    Attributes:
        token_ids: Prompt and every turn, concatenated.
        logprobs: Rollout logprob of each token; 0.0 where ``loss_mask`` is False.
        loss_mask: True exactly on model-sampled tokens.
        weight_versions: Weight version of each model turn, in order (turns whose server reported
            none are left out).
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def model_tokens(self) -> int:
        """How many tokens the model generated."""
        return sum(self.loss_mask)

    @property
    def oldest_version(self) -> int | None:
        """Oldest weight version among the model turns (None before the first turn)."""
        return min(self.weight_versions) if self.weight_versions else None

    @property
    def mixed_versions(self) -> bool:
        """True when model turns came from more than one weight version."""
        return len(set(self.weight_versions)) > 1


class TrajectoryBuilder:
    """Builds one play's trajectory turn by turn.

    Args:
        template: The policy's chat template and tokenizer.
        tools: OpenAI tool schemas passed to the template (tool envs), or None.

    Raises:
        TemplateError: The template's rendering of an assistant turn is not the generation prompt
            followed by the content (the probe shows how it closes a turn).
    """

    def __init__(self, template: ChatTemplate, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self._template = template
        self._tools = list(tools) if tools else None
        self.trajectory = Trajectory()
        self._last_output: list[int] = []
        self._last_cut = False
        probe = [{"role": "user", "content": _PROBE_USER}]
        opened = template.render(probe, tools=self._tools, generation_prompt=True)
        self._probe_closed_messages = [*probe, {"role": "assistant", "content": _PROBE_ASSISTANT}]
        self._probe_closed = template.render(self._probe_closed_messages, tools=self._tools, generation_prompt=False)
        head = opened + _PROBE_ASSISTANT
        if not self._probe_closed.startswith(head):
            raise TemplateError(
                "the chat template does not render an assistant turn as the generation prompt followed by "
                "its content; token-in/token-out trajectories need a template that extends by appending"
            )
        self.turn_closing = self._probe_closed[len(head) :]
        """What the template writes after an assistant turn's content (e.g. ``<|im_end|>\\n``)."""

    def start(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Append the prompt (mask 0) and return its ids.

        Raises:
            RuntimeError: The trajectory already started.
        """
        if self.trajectory.token_ids:
            raise RuntimeError("start() called twice on one trajectory")
        ids = self._template.encode(self._template.render(messages, tools=self._tools, generation_prompt=True))
        self._append_context(ids)
        return ids

    def add_generation(
        self, output_ids: Sequence[int], logprobs: Sequence[float], weight_version: int | None, *, cut: bool
    ) -> None:
        """Append model tokens exactly as sampled (mask 1).

        Args:
            output_ids: Sampled token ids (including a stop token if the server returned it).
            logprobs: Rollout logprob of each sampled token.
            weight_version: Weight version that produced them (None when the server did not say).
            cut: True when generation stopped on the token limit (no end-of-turn was emitted).

        Raises:
            ValueError: ``logprobs`` does not have one value per token.
        """
        if len(output_ids) != len(logprobs):
            raise ValueError(
                f"generation returned {len(output_ids)} tokens but {len(logprobs)} logprobs; the learner "
                "needs one rollout logprob per sampled token (request return_logprob)"
            )
        t = self.trajectory
        t.token_ids.extend(int(i) for i in output_ids)
        t.logprobs.extend(float(x) for x in logprobs)
        t.loss_mask.extend([True] * len(output_ids))
        if weight_version is not None:
            t.weight_versions.append(int(weight_version))
        self._last_output = list(output_ids)
        self._last_cut = cut

    def delta_ids(self, new_messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Ids that close the last model turn and render ``new_messages`` plus the next generation prompt.

        Whatever part of the template's turn closing the model already emitted (its stop token) is
        not repeated; a turn cut by the token limit gets the whole closing.

        Raises:
            TemplateError: The template rewrites earlier turns when messages are appended.
        """
        rendered = self._template.render(
            [*self._probe_closed_messages, *new_messages], tools=self._tools, generation_prompt=True
        )
        if not rendered.startswith(self._probe_closed):
            raise TemplateError("the chat template changes earlier turns when a message is appended")
        suffix = rendered[len(self._probe_closed) :]
        return self._template.encode(self._missing_closing() + suffix)

    def add_messages(self, new_messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Append the template delta for ``new_messages`` (mask 0) and return its ids."""
        ids = self.delta_ids(new_messages)
        self.add_delta(ids)
        return ids

    def add_delta(self, ids: Sequence[int]) -> None:
        """Append ids computed by ``delta_ids`` (mask 0, logprob 0)."""
        self._append_context(ids)

    def _missing_closing(self) -> str:
        closing = self.turn_closing
        if self._last_cut or not self._last_output:
            return closing
        emitted = self._template.decode(self._last_output)
        for j in range(len(closing), 0, -1):
            if emitted.endswith(closing[:j]):
                return closing[j:]
        return closing

    def _append_context(self, ids: Sequence[int]) -> None:
        t = self.trajectory
        t.token_ids.extend(int(i) for i in ids)
        t.logprobs.extend([0.0] * len(ids))
        t.loss_mask.extend([False] * len(ids))
