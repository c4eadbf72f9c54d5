r"""Known repairs of LLM-written env code, applied before validation.

The one frequent defect is ``\boxed{...}`` inside an f-string written with single braces:
``f"Use \\boxed{push N}"`` does not parse, and ``f"Reply \\boxed{done}"`` parses but raises
``NameError`` when run. Both are fixed whatever the braces contain (the reference fixed only the
first kind). A ``"\boxed"`` in a plain string, where ``\b`` is a backspace, is fixed too. Repairs
never change code whose behaviour anyone could have meant. Standard library only.
"""

from __future__ import annotations

import ast
import builtins
import io
import re
import tokenize

from spade.envs.parsing import parse

_BUILTINS = frozenset(dir(builtins))

_PYTHON_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_ANY_FENCE = re.compile(r"```[ \t]*[a-zA-Z0-9_+-]*[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_BOXED_BEFORE = re.compile(r"\\+boxed\s*$")
_BACKSPACE_BOXED = re.compile(r"(?<!\\)((?:\\\\)*)\\boxed")
_STRING_PREFIX = re.compile(r"^([a-zA-Z]*)('''|\"\"\"|'|\")")
_MAX_PASSES = 20
# The cheap test (``needs_repair``): what the source must contain for any repair to change it.
_BOXED_FIELD = re.compile(r"boxed\s*\{(?!\{)")
_FSTRING_OPEN = re.compile(r"""(?<!\w)(?:[rRbB]?[fF]|[fF][rRbB])(?:'|")""")
_CONTINUED_LINE = re.compile(r"\\(?:\r\n|\r|\n)")
_FSTRING_PREFIXES = (frozenset({"f"}), frozenset({"rf", "bf", "fr", "fb"}))
"""String prefixes that make an f-string, by length (lower case)."""


def extract_code(text: str) -> str:
    """The env code in an LLM reply: the first ```` ```python ```` block, else the first fenced
    block, else the whole text. An unclosed fence (a cut-off reply) runs to the end.

    >>> extract_code("Here:\\n```python\\nx = 1\\n```\\nHint: ...")
    'x = 1\\n'
    """
    for pattern in (_PYTHON_FENCE, _ANY_FENCE):
        match = pattern.search(text)
        if match:
            return match.group(1)
    return text


def _line_offsets(code: str) -> list[int]:
    offsets = [0]
    for line in code.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line))
    return offsets


def _string_spans(code: str) -> list[tuple[int, int]]:
    """Absolute (start, end) offsets of every string literal token, f-strings included."""
    offsets = _line_offsets(code)
    spans: list[tuple[int, int]] = []
    fstring_start = getattr(tokenize, "FSTRING_START", None)  # Python >= 3.12 splits f-strings
    fstring_end = getattr(tokenize, "FSTRING_END", None)
    depth = 0
    open_at = 0
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            start = offsets[tok.start[0] - 1] + tok.start[1]
            end = offsets[tok.end[0] - 1] + tok.end[1]
            if fstring_start is not None and tok.type == fstring_start:
                if depth == 0:
                    open_at = start
                depth += 1
            elif fstring_end is not None and tok.type == fstring_end:
                depth -= 1
                if depth == 0:
                    spans.append((open_at, end))
            elif tok.type == tokenize.STRING and depth == 0:
                spans.append((start, end))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass  # Keep the spans found before the lexer gave up.
    return spans


def _is_expression_field(content: str) -> bool:
    """Whether ``content`` is a valid f-string replacement field body (expression, ``=``,
    ``!conversion``, ``:format``)."""
    if not content.strip():
        return False
    candidates = [content]
    candidates += [content[:i] for i, ch in enumerate(content) if ch in ":!="]
    for candidate in candidates:
        body = candidate[:-1] if candidate.endswith("=") else candidate
        if not body.strip():
            continue
        try:
            compile("(" + body + "\n)", "<field>", "eval")
        except SyntaxError:
            continue
        return True
    return False


def _bound_names(code: str) -> frozenset[str]:
    """Every name the code binds anywhere (assignments, arguments, imports, defs)."""
    try:
        tree = parse(code)
    except (SyntaxError, ValueError):
        return frozenset(re.findall(r"\b([A-Za-z_]\w*)\s*=(?!=)", code)) | {"self"}
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return frozenset(names)


def _is_value(content: str, bound: frozenset[str]) -> bool:
    """Whether a boxed field's content is an interpolated value, not a literal command.

    Only compound expressions over names the code binds count (``self.secret``,
    ``len(self.code)``); a bare word (``done``, ``answer``) or anything that is not an
    expression is a literal, whatever variables share its name.
    """
    try:
        tree = parse(content.strip(), mode="eval")
    except SyntaxError:
        return False
    if isinstance(tree.body, ast.Name | ast.Constant):
        return False
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    return bool(names & bound) and names <= bound | _BUILTINS


def _rewrite_fstring_body(body: str, generic: bool, bound: frozenset[str]) -> tuple[str, int, int]:
    """Double the braces of boxed fields (and, if ``generic``, of every field that is not an
    expression, and of lone ``}``). Returns the new body and the counts of both kinds of fix."""
    out: list[str] = []
    boxed = other = 0
    i = 0
    while i < len(body):
        ch = body[i]
        if body.startswith("{{", i) or body.startswith("}}", i):
            out.append(body[i : i + 2])
            i += 2
            continue
        if ch == "}":
            if generic:
                out.append("}}")
                other += 1
            else:
                out.append(ch)
            i += 1
            continue
        if ch != "{":
            out.append(ch)
            i += 1
            continue
        depth, j = 0, i
        while j < len(body):
            if body[j] == "{":
                depth += 1
            elif body[j] == "}":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        if j >= len(body):  # Unclosed field: leave it for the parser to report.
            out.append(body[i:])
            break
        content = body[i + 1 : j]
        if _BOXED_BEFORE.search("".join(out)):
            # `\boxed{self.secret}` meant the value inside the box; `\boxed{done}` meant the word.
            out.append("{{{" + content + "}}}" if _is_value(content, bound) else "{{" + content + "}}")
            boxed += 1
        elif generic and not _is_expression_field(content):
            out.append("{{" + content + "}}")
            other += 1
        else:
            out.append(body[i : j + 1])
        i = j + 1
    return "".join(out), boxed, other


def _rewrite_literal(literal: str, generic: bool, bound: frozenset[str]) -> tuple[str, int, int, int]:
    """Repair one string literal token; returns it with (boxed, other, backspace) fix counts."""
    match = _STRING_PREFIX.match(literal)
    if match is None:
        return literal, 0, 0, 0
    prefix, quote = match.group(1).lower(), match.group(2)
    if "b" in prefix or not literal.endswith(quote) or len(literal) < len(prefix) + 2 * len(quote):
        return literal, 0, 0, 0
    body = literal[len(match.group(0)) : len(literal) - len(quote)]
    backspace = 0
    if "r" not in prefix:
        body, backspace = _BACKSPACE_BOXED.subn(lambda m: m.group(1) + "\\\\boxed", body)
    boxed = other = 0
    if "f" in prefix:
        body, boxed, other = _rewrite_fstring_body(body, generic, bound)
    return match.group(0) + body + quote, boxed, other, backspace


def _rewrite(code: str, generic: bool) -> tuple[str, int, int, int]:
    bound = _bound_names(code)
    totals = [0, 0, 0]
    parts: list[str] = []
    pos = 0
    for start, end in _string_spans(code):
        new, *counts = _rewrite_literal(code[start:end], generic, bound)
        for k, n in enumerate(counts):
            totals[k] += n
        parts.append(code[pos:start])
        parts.append(new)
        pos = end
    parts.append(code[pos:])
    return "".join(parts), totals[0], totals[1], totals[2]


def _parses(code: str) -> bool:
    try:
        parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


def _odd_backslash_boxed(code: str) -> bool:
    r"""Whether some ``boxed`` comes right after an odd run of backslashes.

    What the pattern ``(?<!\\)(?:\\\\)*\\boxed`` finds, by ``str.find``: a search that starts with a
    look-behind tries every position of the code, tens of times slower.
    """
    at = code.find("\\boxed")
    while at >= 0:
        run = 1
        while run <= at and code[at - run] == "\\":
            run += 1
        if run % 2:
            return True
        at = code.find("\\boxed", at + 1)
    return False


def _opens_triple_fstring(code: str) -> bool:
    r"""Whether a triple quote follows an f-string prefix that starts a word.

    What the pattern ``(?<!\w)(?:[rRbB]?[fF]|[fF][rRbB])`` followed by a triple quote finds, by
    ``str.find``.
    """
    for quote in ("'''", '"""'):
        at = code.find(quote)
        while at >= 0:
            for size, prefixes in enumerate(_FSTRING_PREFIXES, 1):
                start = at - size
                prefix = code[start:at] if start >= 0 else ""
                if prefix.isascii() and prefix.lower() in prefixes:
                    before = code[start - 1] if start else ""
                    if not (before.isalnum() or before == "_"):  # what \w matches in a str pattern
                        return True
            at = code.find(quote, at + 1)
    return False


def needs_repair(code: str) -> bool:
    r"""Whether the known repairs might change ``code`` even if it parses: a cheap textual test.

    False guarantees that ``repair_code`` leaves code that parses untouched (and it then skips the
    tokenizer); True only means "look closer". The repairs need a BOM, a ``\boxed`` after an odd
    run of backslashes (a backspace in a non-raw string), or a single-brace ``boxed{`` on a line
    that opens an f-string (or anywhere, once a triple-quoted f-string or a continued line could
    carry an f-string across lines).

    >>> needs_repair('q = "\\\\boxed{ok}"\nm = f"{q}!"\n')
    False
    >>> needs_repair('m = f"Reply \\\\boxed{done}"\n')
    True
    """
    if code.startswith("\ufeff"):
        return True
    if "boxed" not in code:
        return False
    if _odd_backslash_boxed(code):
        return True
    if not _BOXED_FIELD.search(code):
        return False
    if _opens_triple_fstring(code) or _CONTINUED_LINE.search(code):
        return True
    return any(_FSTRING_OPEN.search(line) for line in code.splitlines() if _BOXED_FIELD.search(line))


def repair_code(code: str) -> tuple[str, list[str]]:
    r"""Apply the known repairs to env ``code``.

    Returns:
        The repaired code and one human-readable line per kind of repair made (empty when the code
        was left as it was).

    >>> fixed, repairs = repair_code('msg = f"Reply \\\\boxed{done} or \\\\boxed{push {n}}"')
    >>> fixed
    'msg = f"Reply \\\\boxed{{done}} or \\\\boxed{{push {n}}}"'
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    if not needs_repair(code) and _parses(code):
        return code, []
    return _repair_thoroughly(code)


def _repair_thoroughly(code: str) -> tuple[str, list[str]]:
    """The repairs themselves: a tokenizer pass over every string literal, then parses."""
    repairs: list[str] = []
    if code.startswith("\ufeff"):
        code = code[1:]
    if "\t" in code and not _parses(code) and _parses(code.expandtabs(4)):
        code = code.expandtabs(4)
        repairs.append("expanded tabs to spaces (mixed indentation did not parse)")
    new, boxed, _, backspace = _rewrite(code, generic=False)
    if boxed:
        repairs.append(f"escaped the braces of {boxed} \\boxed{{...}} field(s) in f-strings")
    if backspace:
        repairs.append(f'escaped the backslash of {backspace} "\\boxed" in non-raw strings (\\b is a backspace)')
    if _parses(new) or not _parses(code):
        code = new
    else:  # Never turn parsing code into code that does not parse.
        repairs.clear()
    fixed_other = 0
    for _ in range(_MAX_PASSES):
        if _parses(code):
            break
        new, _, other, _ = _rewrite(code, generic=True)
        if other == 0 or new == code:
            break
        code = new
        fixed_other += other
    if fixed_other:
        repairs.append(f"escaped {fixed_other} f-string brace(s) that were not valid replacement fields")
    return code, repairs
