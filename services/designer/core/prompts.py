"""Designer prompts for both settings, fitted to a token budget.

A prompt is built from (DESIGN §1, issue 6): the environment contract, the agent's budget (its turn
and token limits from the run spec: ``solution()`` must win within them, DESIGN §3), one complete
example environment with its hint (written in the exact answer format, so it doubles as a format
demonstration), the target skill, one corpus document, memory positives and negatives (code excerpts
with the reason they are shown), and difficulty guidance.

Small models have small contexts (SmolLM2-135M: 8192 tokens), so ``fit_prompt`` shrinks the optional
parts until the chat-templated prompt fits ``max_prompt_tokens``. Grounding comes first: the corpus
document is the main source of diversity (the paper), so everything else gives way before it goes.
In order: memory excerpts are shortened, then memory examples dropped (negatives first); the example
env is cut to its beginning (halving its lines); the document is halved down to ``doc_min_words``;
the example is dropped; only then does the document shrink to nothing. The contract, the budget and
the task never go. Lengths are measured with the real tokenizer, never estimated.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from services.designer.core.parsing import HINT_MARKER
from services.designer.core.ports import MemoryExample, MemoryExamples
from services.designer.core.skills import Skill
from spade.envs.types import Setting

Messages = list[dict[str, str]]

TRUNCATION_MARK = "[... truncated]"

SYSTEM_PROMPT = (
    "You are an environment designer. You write complete, executable Python environments that train "
    "a reasoning agent, and a short privileged hint that helps the agent without giving the answer. "
    f"You always answer with exactly one ```python code block, then a line '{HINT_MARKER}', then the hint."
)

GAME_CONTRACT = """\
Write one game class whose name ends in `Env`:
- `reset(self, seed=None)` returns `(observation: str, info: dict)`. Create all randomness with
  `self.rng = random.Random(seed)`; never use the global `random` module. Different seeds must give
  different instances; the same seed and the same actions must give the same observations.
- `step(self, action: str)` returns `(observation: str, reward: float, terminated: bool,
  truncated: bool, info: dict)`. The agent writes each command as `\\boxed{...}`; parse it and answer
  malformed commands with a clear message, never an exception.
- Reward 1.0 for a win, partial rewards in [0, 1]; the episode return is the final reward.
- `solution(self)` returns the list of actions (each a `\\boxed{...}` string) that wins the instance
  created by the last `reset()`.
- `max_turns` (int attribute): the episode is truncated when it is reached.
- Every observation shows the state, the result of the last action and the available commands.
- Standard library only; no input(), files, network or printing."""

TOOL_CONTRACT = """\
Write one class whose name ends in `Env` and subclasses `ToolEnv` (`from spade.envs import ToolEnv`).
`ToolEnv` owns `reset()` and `step()`; you write:
- `tools`: a class attribute, a list of OpenAI function schemas `{"name", "description",
  "parameters"}` (nested object and array arguments and `enum` allowed);
- one method `tool_<name>(self, **arguments) -> str` per tool; raise or return a clear error
  message for bad input (the agent sees it and can recover);
- `setup(self, rng)`: build the backend `self.state`, 3 to 5 user requests in `self.instructions`
  and one `criterion(state) -> bool` per request in `self.criteria`, using only `rng` for randomness.
  Every criterion must be False right after setup;
- `solution(self)`: per instruction, the list of calls `{"name": ..., "arguments": {...}}` that
  complete it on this instance.
An instruction completes only when a call of its own solution flips its criterion to True; the next
instruction then arrives as a new user turn. Standard library only; no input(), files or network."""

CONTRACTS = {Setting.GAME: GAME_CONTRACT, Setting.TOOL: TOOL_CONTRACT}

DIFFICULTY = {
    Setting.GAME: (
        "Aim for the edge of the agent's ability: a careful player without the hint often fails, "
        "the same player with the hint wins. Winning needs at least 3 meaningful actions and at least "
        "2 different kinds of action; a random or do-nothing player must lose. Avoid guessing games, "
        "linear search and one-shot answers. The game must use the concept of the document, not quote it."
    ),
    Setting.TOOL: (
        "Aim for the edge of the agent's ability: each instruction needs 2 or more dependent calls, "
        "values the agent must look up rather than guess, and at least one enum argument. Add 1 or 2 "
        "distractor tools. A call outside an instruction's solution must not complete it. Use the "
        "document only as flavour for the domain."
    ),
}

HINT_GUIDANCE = {
    Setting.GAME: "the key insight that makes the game solvable; never the answer or the action sequence",
    Setting.TOOL: "a step plan naming the tool roles in order (look up, then update, ...), with no argument values",
}


@dataclass(frozen=True)
class AgentBudget:
    """The agent's budget, as the run spec fixes it and the prompt states it.

    Attributes:
        max_turns: Turns per play (one ``step()`` each); ``solution()`` must win within them.
        max_tokens_per_turn: Tokens the agent may write in one turn.
    """

    max_turns: int = 25
    max_tokens_per_turn: int = 8192


#: The shortest memory excerpt and example beginning the budget shrinks them to before dropping them.
MIN_EXCERPT_CHARS = 300
MIN_EXAMPLE_LINES = 24
EXAMPLE_CUT_MARK = "# ... (the rest of this example is omitted)"


@dataclass(frozen=True)
class ExampleEnv:
    """One complete example environment shown in the prompt.

    Attributes:
        name: Its class or registry name.
        code: Full source.
        hint: Its hint, shown after the code in the answer format.
    """

    name: str
    code: str
    hint: str


@dataclass(frozen=True)
class PromptParts:
    """Everything one designer prompt is built from.

    Attributes:
        setting: ``"game"`` or ``"tool"``.
        skill: The target skill.
        document: Corpus document text (already truncated to the configured word budget), or ``""``.
        example: The example environment, or ``None`` to leave it out.
        memory: Earlier environments to imitate and to avoid.
        excerpt_chars: Memory code excerpts are cut to this many characters.
        budget: The agent's budget, stated in the contract section.
        example_lines: Show only the example's first lines (``None``: all of it).
    """

    setting: str
    skill: Skill
    document: str = ""
    example: ExampleEnv | None = None
    memory: MemoryExamples = field(default_factory=MemoryExamples)
    excerpt_chars: int = 1200
    budget: AgentBudget = field(default_factory=AgentBudget)
    example_lines: int | None = None


@dataclass(frozen=True)
class FittedPrompt:
    """A prompt that fits the budget, with what was kept.

    Attributes:
        messages: Chat messages (system + user).
        prompt_ids: Their chat-templated token ids (what the model is conditioned on and trained with).
        parts: The parts actually used (after shrinking).
    """

    messages: Messages
    prompt_ids: list[int]
    parts: PromptParts


class PromptTooLong(ValueError):
    """Even the minimal prompt (contract, skill, instructions) exceeds the token budget."""


def truncate_words(text: str, max_words: int) -> str:
    """Keep the first ``max_words`` whitespace-separated words of ``text``, layout preserved.

    A truncated text ends with ``[... truncated]`` on its own line.

    >>> truncate_words("a b\\n  c d", 3)
    'a b\\n  c\\n[... truncated]'
    >>> truncate_words("a b", 5)
    'a b'
    """
    if max_words <= 0:
        return ""
    for count, match in enumerate(re.finditer(r"\S+", text), start=1):
        if count == max_words:
            rest = text[match.end() :]
            if rest.strip():
                return text[: match.end()] + "\n" + TRUNCATION_MARK
            return text
    return text


def _excerpt(code: str, limit: int) -> str:
    code = code.strip()
    if len(code) <= limit:
        return code
    cut = code[:limit]
    # End on a whole line so the excerpt still reads as code.
    if "\n" in cut:
        cut = cut[: cut.rfind("\n")]
    return cut + "\n# ... (truncated)"


def _memory_block(title: str, examples: tuple[MemoryExample, ...], limit: int) -> str:
    parts = [title]
    for index, example in enumerate(examples, start=1):
        parts.append(f"[{index}] {example.reason}\n```python\n{_excerpt(example.code, limit)}\n```")
    return "\n".join(parts)


def render_budget(setting: str, budget: AgentBudget) -> str:
    """The section telling the designer the agent's budget (part of the contract, DESIGN §3)."""
    turns, tokens = budget.max_turns, budget.max_tokens_per_turn
    if setting == Setting.TOOL:
        episode = (
            f"The agent has at most {turns} turns for the whole episode, all instructions together (one "
            f"`step()` with its tool calls per turn), and writes at most {tokens} tokens per turn. The calls "
            f"of `solution()` must complete every instruction within {turns} turns"
        )
    else:
        episode = (
            f"The agent plays at most {turns} turns per episode (one `step()` per turn) and writes at most "
            f"{tokens} tokens per turn. `solution()` must win within {turns} actions on every seed"
        )
    return (
        f"## The agent's budget\n{episode}; `max_turns` must be at most {turns} (a larger value is cut to "
        f"{turns}). Keep observations short enough to read within the budget."
    )


def _example_code(parts: PromptParts) -> tuple[str, bool]:
    assert parts.example is not None
    lines = parts.example.code.strip().splitlines()
    if parts.example_lines is None or parts.example_lines >= len(lines):
        return "\n".join(lines), False
    return "\n".join([*lines[: parts.example_lines], EXAMPLE_CUT_MARK]), True


def render_user_prompt(parts: PromptParts) -> str:
    """The user message for ``parts`` (no budget applied)."""
    setting = Setting.parse(parts.setting)
    sections = [f"## Environment contract\n{CONTRACTS[setting]}", render_budget(setting, parts.budget)]
    if parts.example is not None:
        code, cut = _example_code(parts)
        what = "its beginning: format and style" if cut else "format and level of completeness"
        sections.append(
            f"## Example answer ({what}; write a different environment)\n"
            f"```python\n{code}\n```\n{HINT_MARKER}\n{parts.example.hint.strip()}"
        )
    if parts.document.strip():
        sections.append(
            "## Reference document\nBuild the environment around a concept from this document.\n"
            f"<REFERENCE_DOCUMENT>\n{parts.document.strip()}\n</REFERENCE_DOCUMENT>"
        )
    memory = []
    if parts.memory.positives:
        memory.append(
            _memory_block(
                "Earlier environments that trained the agent well (match their quality, "
                "but write a DIFFERENT environment):",
                parts.memory.positives,
                parts.excerpt_chars,
            )
        )
    if parts.memory.negatives:
        memory.append(_memory_block("Avoid environments like these:", parts.memory.negatives, parts.excerpt_chars))
    if memory:
        sections.append("## Earlier environments\n" + "\n\n".join(memory))
    sections.append(
        "## Your task\n"
        f"Target skill: {parts.skill.name} — {parts.skill.description}.\n"
        f"Difficulty: {DIFFICULTY[setting]}\n"
        "Answer with exactly one ```python block containing the complete environment, then a line "
        f"'{HINT_MARKER}', then the hint: {HINT_GUIDANCE[setting]}."
    )
    return "\n\n".join(sections)


def render_messages(parts: PromptParts) -> Messages:
    """System and user messages for ``parts``."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": render_user_prompt(parts)},
    ]


def _shrink_ladder(parts: PromptParts, doc_min_words: int) -> Iterator[PromptParts]:
    """Ever smaller variants of ``parts``, in the order the budget gives things up (grounding last)."""
    yield parts
    # 1. Memory examples: shorter excerpts, then fewer of them (negatives first).
    memory = parts.memory
    chars = parts.excerpt_chars
    while (memory.positives or memory.negatives) and chars // 2 >= MIN_EXCERPT_CHARS:
        chars //= 2
        parts = replace(parts, excerpt_chars=chars)
        yield parts
    while memory.negatives or memory.positives:
        if memory.negatives:
            memory = MemoryExamples(memory.positives, memory.negatives[:-1])
        else:
            memory = MemoryExamples(memory.positives[:-1], ())
        parts = replace(parts, memory=memory)
        yield parts
    # 2. The example env: its beginning only.
    if parts.example is not None:
        lines = len(parts.example.code.strip().splitlines())
        while lines > MIN_EXAMPLE_LINES:
            lines = max(lines // 2, MIN_EXAMPLE_LINES)
            parts = replace(parts, example_lines=lines)
            yield parts
    # 3. The document, halved down to its floor.
    original = parts.document.removesuffix("\n" + TRUNCATION_MARK)
    words = len(original.split())
    while words // 2 >= max(doc_min_words, 1):
        words //= 2
        parts = replace(parts, document=truncate_words(original, words))
        yield parts
    # 4. The example goes before the document does.
    if parts.example is not None:
        parts = replace(parts, example=None, example_lines=None)
        yield parts
    # 5. Last, the document.
    while parts.document:
        words //= 2
        parts = replace(parts, document=truncate_words(original, words) if words else "")
        yield parts


def fit_prompt(
    parts: PromptParts,
    tokenize: Callable[[Messages], list[int]],
    *,
    max_prompt_tokens: int,
    doc_min_words: int = 100,
) -> FittedPrompt:
    """Render ``parts`` into messages whose chat-templated length is at most ``max_prompt_tokens``.

    Args:
        parts: The full prompt parts (document already cut to the configured maximum of words).
        tokenize: Chat template + tokenizer of the policy (``PolicyLLM.apply_chat_template``).
        max_prompt_tokens: The budget.
        doc_min_words: The document is halved down to this many words before the example env goes.

    Raises:
        PromptTooLong: Even contract + task alone exceed the budget; raise ``max_prompt_tokens``.
    """
    smallest = 0
    for candidate in _shrink_ladder(parts, doc_min_words):
        messages = render_messages(candidate)
        ids = tokenize(messages)
        smallest = len(ids)
        if len(ids) <= max_prompt_tokens:
            return FittedPrompt(messages=messages, prompt_ids=ids, parts=candidate)
    raise PromptTooLong(
        f"the minimal {parts.setting} designer prompt is {smallest} tokens, over max_prompt_tokens="
        f"{max_prompt_tokens}: raise SPADE_DESIGNER_MAX_PROMPT_TOKENS (and the model's context if needed)"
    )
