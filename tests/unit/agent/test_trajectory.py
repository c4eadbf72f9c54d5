"""Trajectory masks, logprob alignment and template deltas against the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from services.rollout.policy import FormatterTemplate
from spade.agent.trajectory import TemplateError, TrajectoryBuilder
from spade.inference.chat import ChatFormatter

END = "<|im_end|>"


def _turn(template: FormatterTemplate, builder: TrajectoryBuilder, text: str, version: int, lp: float) -> list[int]:
    ids = template.encode(text + END)
    builder.add_generation(ids, [lp] * len(ids), version, cut=False)
    return ids


def test_multi_turn_sequence_equals_the_rendered_conversation_and_masks_only_model_tokens(
    template: FormatterTemplate, formatter: ChatFormatter
) -> None:
    builder = TrajectoryBuilder(template)
    convo = [{"role": "user", "content": "Observation: 3 coins. Answer in \\boxed{}."}]
    prompt = builder.start(convo)
    assert prompt == formatter.apply(convo)  # the same ids the inference client would send
    a1 = _turn(template, builder, "I take \\boxed{1}", 4, -0.5)
    builder.add_messages([{"role": "user", "content": "2 coins left."}])
    a2 = _turn(template, builder, "Then \\boxed{2}", 5, -0.25)
    convo += [
        {"role": "assistant", "content": "I take \\boxed{1}"},
        {"role": "user", "content": "2 coins left."},
        {"role": "assistant", "content": "Then \\boxed{2}"},
    ]
    t = builder.trajectory
    # Token-in/token-out: the sequence is the conversation rendered once by the template.
    assert template.decode(t.token_ids) == formatter.render(convo, add_generation_prompt=False).rstrip("\n")
    assert len(t.token_ids) == len(t.logprobs) == len(t.loss_mask)
    model_positions = [i for i, m in enumerate(t.loss_mask) if m]
    assert [t.token_ids[i] for i in model_positions] == a1 + a2
    assert [t.logprobs[i] for i in model_positions] == [-0.5] * len(a1) + [-0.25] * len(a2)
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if not m)
    assert t.model_tokens == len(a1) + len(a2)
    assert t.weight_versions == [4, 5] and t.oldest_version == 4 and t.mixed_versions


def test_model_tokens_are_kept_exactly_even_when_retokenising_would_differ(template: FormatterTemplate) -> None:
    builder = TrajectoryBuilder(template)
    builder.start([{"role": "user", "content": "hi"}])
    # Sample "hello" as single characters: a re-tokenisation of the text would merge them.
    odd = [template.encode(c)[0] for c in "hello"] + template.encode(END)
    assert odd != template.encode("hello" + END)
    builder.add_generation(odd, [-1.0] * len(odd), 0, cut=False)
    builder.add_messages([{"role": "user", "content": "again"}])
    t = builder.trajectory
    start = t.loss_mask.index(True)
    assert t.token_ids[start : start + len(odd)] == odd


def test_a_turn_cut_by_the_token_limit_gets_the_whole_closing_unmasked(template: FormatterTemplate) -> None:
    builder = TrajectoryBuilder(template)
    builder.start([{"role": "user", "content": "hi"}])
    cut = template.encode("I think the answer is")
    builder.add_generation(cut, [-0.1] * len(cut), 0, cut=True)
    delta = builder.add_messages([{"role": "user", "content": "go on"}])
    text = template.decode(delta)
    assert text.startswith(builder.turn_closing)  # <|im_end|> closed for the model, not trained on
    assert text.endswith("<|im_start|>assistant\n")
    assert builder.trajectory.loss_mask[-len(delta) :] == [False] * len(delta)


def test_tool_results_and_tools_render_through_the_formatter(
    template: FormatterTemplate, formatter: ChatFormatter
) -> None:
    tools = [{"type": "function", "function": {"name": "count", "description": "Count.", "parameters": {}}}]
    builder = TrajectoryBuilder(template, tools)
    prompt = builder.start([{"role": "user", "content": "Count the notes."}])
    assert '"count"' in template.decode(prompt)  # tools reach the model even though SmolLM2 ignores them
    _turn(template, builder, '<tool_call>{"name": "count", "arguments": {}}</tool_call>', 0, -0.3)
    delta = builder.add_messages(
        [{"role": "tool", "name": "count", "content": "2"}, {"role": "user", "content": "Now add one."}]
    )
    text = template.decode(delta)
    assert "<tool_response>\n2\n</tool_response>" in text and "Now add one." in text


def test_logprob_count_must_match_tokens(template: FormatterTemplate) -> None:
    builder = TrajectoryBuilder(template)
    builder.start([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="one rollout logprob per sampled token"):
        builder.add_generation([1, 2, 3], [-1.0], 0, cut=False)


class _RewritingTemplate:
    """A template that re-renders history when a message is appended (deltas are impossible)."""

    def render(self, messages, *, tools, generation_prompt):
        body = "|".join(m["content"] for m in messages)
        return f"[{len(messages)}]{body}" + ("<a>" if generation_prompt else "")

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    decode_reply = decode


def test_a_template_that_rewrites_history_is_refused() -> None:
    with pytest.raises(TemplateError, match="extends by appending"):
        TrajectoryBuilder(_RewritingTemplate())
