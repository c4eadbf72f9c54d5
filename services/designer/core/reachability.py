r"""``criteria_reachable``: the policy judges whether each tool criterion can be made true (tool setting).

The sandbox's checks execute the env (``solution()`` must win, criteria false at reset, off-solution
calls must not complete an instruction), but they cannot see a criterion that only a different
reading of the instructions would satisfy, or one whose state no tool writes apart from the
solution's own hard-coded path. The paper adds an LLM judge for tool envs (REFERENCE.md §2 item 6):
the policy itself traces each criterion to the tool that writes its state.

Its judge accepted an env when the reply had no ``\boxed{}`` verdict, was empty or raised. Here a
verdict is one of three explicit values, and only ``reachable`` passes:

- ``reachable``: every per-criterion box says yes;
- ``unreachable``: some box says no (the check names which criteria);
- ``unknown``: no box, an empty reply, or a box that is neither yes nor no. It is retried up to the
  configured number of tries, then reported as a failed check saying it is unknown: an env is never
  accepted on a verdict nobody gave.

>>> parse_verdict("Criterion 1: \\boxed{yes}\nCriterion 2: \\boxed{no}").verdict.value
'unreachable'
>>> parse_verdict("I think it works.").verdict.value
'unknown'
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from services.designer.core.ports import PolicyLLM, Sampling
from spade.envs.types import CheckResult

CRITERIA_REACHABLE_CHECK = "criteria_reachable"

#: The reply format the structured-output grammar enforces: one verdict line per criterion.
VERDICT_REGEX = r"(Criterion [1-9]: \\boxed\{(yes|no)\}\n){1,9}"

SYSTEM_PROMPT = (
    "You review tool-use environments written in Python for training an AI agent. You judge only "
    "whether each instruction's success criterion can be made true by some sequence of the "
    "environment's tool calls. You never judge difficulty."
)

USER_PROMPT = """\
```python
{code}
```

For each instruction in `self.instructions`, in order, trace its criterion in `self.criteria`: which
part of `self.state` does it read, which tool method writes that part, and can arguments the agent
can learn (from the instruction text or from other tools' outputs) make the criterion true?
A criterion is unreachable when no tool writes what it reads, when it contradicts itself or the
state's types, when a tool it needs always fails, or when it needs a value the agent can never learn.

Reason briefly, then end with one line per instruction, exactly like:
Criterion 1: \\boxed{{yes}}
Criterion 2: \\boxed{{no}}"""

_YES = frozenset({"yes", "y", "true", "reachable"})
_NO = frozenset({"no", "n", "false", "unreachable"})
_BOX = re.compile(r"\\boxed\{\s*([^{}]*?)\s*\}")
_LABELLED = re.compile(r"criterion\s*#?\s*(\d+)\s*[:.)-]?\s*\\boxed\{\s*([^{}]*?)\s*\}", re.IGNORECASE)


class Reachability(enum.Enum):
    """The judge's verdict on an env's criteria."""

    REACHABLE = "reachable"
    UNREACHABLE = "unreachable"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Verdict:
    """A parsed reply.

    Attributes:
        verdict: The verdict.
        answers: Per criterion (in the reply's order, or by its labels): True (yes), False (no),
            None (neither).
        detail: What was read, in words.
    """

    verdict: Reachability
    answers: tuple[bool | None, ...]
    detail: str


def _answer(text: str) -> bool | None:
    word = text.strip().strip(".").lower()
    if word in _YES:
        return True
    if word in _NO:
        return False
    return None


def parse_verdict(text: str) -> Verdict:
    """The verdict of one reply (see the module docstring).

    Labelled lines (``Criterion 2: \\boxed{no}``) name their criterion; without labels, the boxes
    are read in order.
    """
    if not text.strip():
        return Verdict(Reachability.UNKNOWN, (), "the reply is empty")
    labelled = _LABELLED.findall(text)
    if labelled:
        by_index: dict[int, bool | None] = {}
        for index, value in labelled:
            by_index[int(index)] = _answer(value)  # a criterion judged twice: the last line counts
        numbers = sorted(by_index)
        answers = tuple(by_index[n] for n in numbers)
    else:
        answers = tuple(_answer(value) for value in _BOX.findall(text))
        numbers = list(range(1, len(answers) + 1))
    if not answers:
        return Verdict(Reachability.UNKNOWN, (), "the reply has no \\boxed{yes} or \\boxed{no} verdict")
    no = [n for n, a in zip(numbers, answers, strict=True) if a is False]
    if no:
        which = ", ".join(str(n) for n in no)
        return Verdict(Reachability.UNREACHABLE, answers, f"criterion {which} judged unreachable")
    unclear = [n for n, a in zip(numbers, answers, strict=True) if a is None]
    if unclear:
        which = ", ".join(str(n) for n in unclear)
        return Verdict(Reachability.UNKNOWN, answers, f"the verdict on criterion {which} is neither yes nor no")
    return Verdict(Reachability.REACHABLE, answers, f"all {len(answers)} criteria judged reachable")


def verdict_messages(code: str) -> list[dict[str, str]]:
    """The judge's chat messages for ``code``."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": USER_PROMPT.format(code=code.strip())},
    ]


def _excerpt(text: str, limit: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else "..." + text[-limit:]


@dataclass(frozen=True)
class ReachabilityConfig:
    """How the judge is asked.

    Attributes:
        sampling: Sampling of the verdict (the reference: temperature 0.3). ``regex`` set when
            structured output is on (then the reply is only the verdict lines).
        tries: Replies asked for before an unknown verdict is final.
        max_prompt_tokens: The judge's prompt (the env's code plus instructions) must fit this.
    """

    sampling: Sampling
    tries: int = 2
    max_prompt_tokens: int = 5632


class CriteriaReachable:
    """The ``criteria_reachable`` check over the policy (the same inference client as the designer).

    Args:
        llm: The policy.
        config: How it is asked.
    """

    def __init__(self, llm: PolicyLLM, config: ReachabilityConfig) -> None:
        if config.tries < 1:
            raise ValueError(f"tries must be >= 1, got {config.tries}")
        self._llm = llm
        self.config = config

    async def check(self, code: str, *, seeds: Sequence[int | None] = ()) -> CheckResult:
        """Ask for the verdict on ``code``; the check passes only on ``reachable``.

        Args:
            code: The env's code (after repairs, as the sandbox validated it).
            seeds: A sampling seed per try (missing ones: unseeded).

        Raises:
            Exception: Whatever the inference client raises (an outage is not a verdict).
        """
        ids = self._llm.apply_chat_template(verdict_messages(code))
        if len(ids) > self.config.max_prompt_tokens:
            return CheckResult(
                CRITERIA_REACHABLE_CHECK,
                False,
                f"unknown: the judge's prompt is {len(ids)} tokens, over max_prompt_tokens="
                f"{self.config.max_prompt_tokens}; raise it or shorten the env",
            )
        last = Verdict(Reachability.UNKNOWN, (), "not asked")
        reply = ""
        for attempt in range(self.config.tries):
            seed = seeds[attempt] if attempt < len(seeds) else None
            generation = await self._llm.generate(list(ids), replace(self.config.sampling, seed=seed))
            reply = generation.text
            last = parse_verdict(reply)
            if last.verdict is not Reachability.UNKNOWN:
                break
        tries = f"reply {attempt + 1} of at most {self.config.tries}"
        if last.verdict is Reachability.REACHABLE:
            return CheckResult(CRITERIA_REACHABLE_CHECK, True, f"{last.detail} ({tries})")
        if last.verdict is Reachability.UNREACHABLE:
            return CheckResult(
                CRITERIA_REACHABLE_CHECK,
                False,
                f"{last.detail} ({tries}): make a tool write the state that criterion reads, with values "
                f"the agent can learn; the judge said: {_excerpt(reply)!r}",
            )
        return CheckResult(
            CRITERIA_REACHABLE_CHECK,
            False,
            f"unknown: {last.detail} after {self.config.tries} replies (last: {_excerpt(reply)!r}); "
            "an env is kept only on a reachable verdict",
        )
