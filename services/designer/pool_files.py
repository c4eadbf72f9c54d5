"""The pool designer's answers, read from a directory (``spade serve designer --pool DIR``).

Each ``*.md`` or ``*.txt`` file (hidden files and ``README*`` skipped), in name order, is one answer:
the exact text a designer model writes, one ```` ```python ```` block, then a line ``### HINT``, then
the hint. Its first line may name the answer's skill, as a comment of any of these forms, which is
removed before the answer is parsed::

    # skill: Logical Deduction
    <!-- skill: Logical Deduction -->

Without it, the answer takes the skill of its slot in the round.
"""

from __future__ import annotations

import re
from pathlib import Path

from services.designer.core.pool import PoolAnswer

SUFFIXES = frozenset({".md", ".txt"})
_SKILL_LINE = re.compile(r"^\s*(?:#|//|<!--)\s*skill\s*:\s*(?P<name>.+?)\s*(?:-->)?\s*$", re.IGNORECASE)


def parse_answer_file(name: str, text: str) -> PoolAnswer:
    """One answer file's text as a :class:`PoolAnswer` (its skill line, if any, taken off).

    >>> parse_answer_file("a.md", "# skill: Optimization\\n```python\\nclass AEnv: ...\\n```").skill
    'Optimization'
    """
    first, newline, rest = text.partition("\n")
    match = _SKILL_LINE.match(first)
    if match is None:
        return PoolAnswer(name=name, text=text)
    return PoolAnswer(name=name, text=rest if newline else "", skill=match.group("name"))


def load_pool(directory: Path) -> list[PoolAnswer]:
    """Every answer file of ``directory``, in name order.

    Raises:
        ValueError: ``directory`` is not a directory, or holds no answer file.
    """
    if not directory.is_dir():
        raise ValueError(f"designer pool {directory} is not a directory: point --pool at a directory of answer files")
    files = sorted(
        path
        for path in directory.iterdir()
        if path.is_file()
        and path.suffix in SUFFIXES
        and not path.name.startswith(".")
        and not path.name.upper().startswith("README")
    )
    if not files:
        raise ValueError(f"designer pool {directory} holds no answer file (*.md or *.txt, one designer answer each)")
    return [parse_answer_file(path.name, path.read_text(encoding="utf-8")) for path in files]


def write_example_pool(directory: Path, setting: str) -> list[Path]:
    """Write the contract's example envs of ``setting`` as answer files (``valid-<name>.md``).

    The pool of the paper's fixed-env baseline over the examples (``--designer-pool DIR``); each file
    names its example's skill on its first line.
    """
    from spade.envs.examples import EXAMPLES
    from spade.inference.answer_format import designer_answer

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, example in sorted(EXAMPLES.items()):
        if str(example.setting) != setting:
            continue
        path = directory / f"valid-{name}.md"
        path.write_text(f"# skill: {example.skill}\n{designer_answer(example.code, example.hint)}\n", encoding="utf-8")
        written.append(path)
    return written
