"""The designer's answer format as a grammar the server can enforce (SGLang ``regex`` / ``ebnf``).

The designer answers with one fenced Python block, then a line ``### HINT``, then the hint (see
``services/designer/core/parsing.py``, whose parser accepts every text these grammars allow)::

    ```python
    class MazeEnv:
        ...
    ```
    ### HINT
    Walls only block moves, so ...

Pass :data:`DESIGNER_ANSWER_REGEX` as ``SamplingParams(regex=...)`` (or :data:`DESIGNER_ANSWER_EBNF`
as ``ebnf=...``): a small model then cannot write a malformed answer, so validation always reaches
its code. What the grammars require beyond the parser, so that what they allow always parses:

- the answer starts with the fence (no prose before it) and the code holds a ``class Name`` line
  (the parser's "no environment class" rule);
- code lines contain no backtick or tilde (a line starting with ```` ``` ```` or ``~~~`` would end the
  block early for the parser); Python envs need neither;
- the hint's first line is not blank (the parser refuses an empty hint section).

A generation cut by ``max_new_tokens`` inside the code is still malformed: give the designer a token
budget its code fits in. One cut inside the hint still parses (the hint is everything after the marker).
"""

from __future__ import annotations

#: The line that opens the hint section (the designer's parser's ``HINT_MARKER``).
HINT_MARKER = "### HINT"

_CODE_LINE = r"[^`~\n]*\n"
_CLASS_LINE = r"[ \t]*class [A-Za-z_][A-Za-z0-9_]*[^`~\n]*\n"
_HINT = r"[ \t]*[^\s][^\n]*(\n[^\n]*)*"

#: SGLang ``regex`` for a designer answer (Python ``re`` syntax; ``re.fullmatch`` checks a text).
DESIGNER_ANSWER_REGEX = (
    r"```python\n" + f"({_CODE_LINE})*" + _CLASS_LINE + f"({_CODE_LINE})*" + r"```\n" + HINT_MARKER + r"\n" + _HINT
)

#: SGLang ``ebnf`` for the same language (xgrammar's EBNF: ``root`` is the start rule).
DESIGNER_ANSWER_EBNF = rf"""root ::= "```python\n" code_line* class_line code_line* "```\n{HINT_MARKER}\n" hint
code_line ::= [^`~\n]* "\n"
class_line ::= [ \t]* "class " [A-Za-z_] [A-Za-z0-9_]* [^`~\n]* "\n"
hint ::= [ \t]* [^ \t\r\n] [^\n]* ("\n" [^\n]*)*
"""


def designer_answer(code: str, hint: str) -> str:
    """Render ``code`` and ``hint`` in the designer's answer format (e.g. for a pool of answers).

    >>> designer_answer("class AEnv:\\n    pass", "Think.")
    '```python\\nclass AEnv:\\n    pass\\n```\\n### HINT\\nThink.'
    """
    return f"```python\n{code.rstrip()}\n```\n{HINT_MARKER}\n{hint.strip()}"
