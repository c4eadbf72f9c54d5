"""Split the designer's output into environment code and the privileged hint.

The designer answers with one fenced Python block followed by a marked hint section::

    ```python
    class MazeEnv: ...
    ```
    ### HINT
    Walls only block moves, so ...

The hint is part of the trained output, so an answer without one is an invalid attempt (with a
reason), never silently completed. Parsing is tolerant of what small models do: a ``HINT:``,
``## Hint`` or ``<hint>...</hint>`` marker, text before the fence, an untagged fence, a missing
closing fence right before the marker. The marker is only recognised outside code fences
(``### HINT`` inside the code is a Python comment, not the hint section).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

HINT_MARKER = "### HINT"
OUTPUT_FORMAT_CHECK = "output_format"

# A marker line: "### HINT", "## Hint:", "**HINT**", "HINT:", "<hint>" (all but the first may carry the
# hint on the same line).
_MARKER = re.compile(
    r"^\s*(?:#{1,6}\s*|\*\*\s*|<)?hint\b\s*(?:\*\*|>)?\s*:?\s*(?:\*\*)?\s*(?P<rest>.*)$", re.IGNORECASE
)
_FENCE = re.compile(r"^\s*(```|~~~)")


@dataclass(frozen=True)
class ParsedOutput:
    """A well-formed designer answer.

    Attributes:
        code: The environment source, as extracted (before repairs).
        hint: The hint text, stripped, at most the configured length.
    """

    code: str
    hint: str


@dataclass(frozen=True)
class ParseFailure:
    """Why an answer is not well-formed; becomes the attempt's failing check.

    Attributes:
        check: Name of the failing check (always ``"output_format"``).
        detail: What is missing and what the designer should have written.
    """

    detail: str
    check: str = OUTPUT_FORMAT_CHECK


def _default_extract(text: str) -> str:
    from spade.envs.repair import extract_code

    return extract_code(text)


def split_hint(text: str) -> tuple[str, str] | None:
    """Split ``text`` at the first hint marker outside code fences.

    Returns:
        ``(before, hint)`` or ``None`` when no marker line exists outside a fence.

    >>> split_hint("```python\\nx = 1  # HINT: no\\n```\\n### HINT\\nThink.")
    ('```python\\nx = 1  # HINT: no\\n```\\n', 'Think.')
    >>> split_hint("```python\\n### HINT\\n```\\n") is None
    True
    """
    lines = text.splitlines(keepends=True)
    in_fence = False
    closed_fences = 0
    before_code: int | None = None  # a marker before any code block: used only if none follows
    unclosed: list[int] = []
    for index, line in enumerate(lines):
        if _FENCE.match(line):
            in_fence = not in_fence
            closed_fences += not in_fence
            continue
        if _MARKER.match(line) is None:
            continue
        if in_fence:
            # Inside a fence "### HINT" is a Python comment, unless the fence is never closed: small
            # models often drop the closing fence before the hint, handled below.
            if line.strip().rstrip(":").upper() == HINT_MARKER:
                unclosed.append(index)
        elif closed_fences:
            return _cut(lines, index)
        elif before_code is None:
            before_code = index
    if in_fence and unclosed:
        return _cut(lines, unclosed[-1])
    if before_code is not None:
        return _cut(lines, before_code)
    return None


def _cut(lines: list[str], index: int) -> tuple[str, str]:
    match = _MARKER.match(lines[index])
    rest = match.group("rest").strip() if match else ""
    after = "".join(lines[index + 1 :])
    hint = (rest + "\n" + after).strip() if rest else after.strip()
    return "".join(lines[:index]), hint


def parse_output(
    text: str,
    *,
    max_hint_chars: int = 2000,
    extract: Callable[[str], str] | None = None,
) -> ParsedOutput | ParseFailure:
    """Parse one designer answer.

    Args:
        text: The generated text.
        max_hint_chars: Longer hints are cut to this many characters (a hint is an insight, not an essay).
        extract: Code extraction for the part before the hint (defaults to
            ``spade.envs.repair.extract_code``: first ```` ```python ```` block, else the whole text).

    Returns:
        The code and hint, or the reason the answer is malformed.
    """
    extract = extract or _default_extract
    if not text.strip():
        return ParseFailure("the answer is empty: write one ```python block, then a '### HINT' section")
    split = split_hint(text)
    if split is None:
        return ParseFailure(
            f"no hint section: after the ```python block write a line '{HINT_MARKER}' followed by the hint"
        )
    before, hint = split
    if "```" in before and before.count("```") % 2 == 1:
        # The closing fence is missing before the marker: close it so extraction sees one block.
        before = before.rstrip() + "\n```\n"
    code = extract(before).strip()
    if not code or not re.search(r"^\s*class\s+\w+", code, re.MULTILINE):
        return ParseFailure("no environment class in a ```python block before the hint section")
    # Fences and a closing </hint> tag are formatting noise, not hint content.
    hint = re.sub(r"```[a-zA-Z]*|</hint\s*>", "", hint, flags=re.IGNORECASE).strip()
    if not hint:
        return ParseFailure(f"the '{HINT_MARKER}' section is empty: state the key insight or step plan")
    if len(hint) > max_hint_chars:
        hint = hint[:max_hint_chars].rstrip()
    return ParsedOutput(code=code, hint=hint)
