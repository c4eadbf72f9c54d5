"""Code normalisation for deduplication: the same program, however formatted, hashes the same.

Comments, docstrings, blank lines and formatting are removed by a round trip through ``ast``:

>>> a = "class E:\\n    'Doc.'\\n    x = 1  # one\\n"
>>> b = "class E:\\n\\n    x   =   1\\n"
>>> code_hash(a) == code_hash(b)
True
>>> code_hash(a) == code_hash("class E:\\n    x = 2\\n")
False

Code that does not parse (an invalid environment is stored too) falls back to dropping blank lines,
``#`` comment lines and trailing whitespace, so trivially reformatted broken code still matches.
"""

from __future__ import annotations

import ast
import hashlib

from spade.envs.parsing import parse

_DOCSTRING_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def normalise_code(code: str) -> str:
    """Return ``code`` without comments, docstrings and formatting (see the module docstring)."""
    try:
        tree = parse(code)
    except (SyntaxError, ValueError):
        lines = (line.rstrip() for line in code.splitlines())
        return "\n".join(line for line in lines if line.strip() and not line.lstrip().startswith("#"))
    for node in ast.walk(tree):
        if isinstance(node, _DOCSTRING_OWNERS) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                node.body = node.body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def code_hash(code: str) -> str:
    """SHA-256 (hex) of the normalised code: equal for programs that differ only in form."""
    return hashlib.sha256(normalise_code(code).encode()).hexdigest()


def env_id_for(digest: str) -> str:
    """The id of the environment whose normalised code hashes to ``digest`` (32 hex digits).

    A content address rather than a random id (``SqlStore(content_env_ids=True)``, the embedded
    run's memory): one memory stores each normalised program once (``code_hash`` is unique), so the
    id is unique there, and the same program gets the same id in every run. Play seeds and sampling
    seeds derive from the env id, so a rerun of a seeded run plays the same seeds with the same
    samples (with random ids every run plays other seeds).

    >>> env_id_for(code_hash("x = 1")) == env_id_for(code_hash("x = 1  # a comment"))
    True
    >>> len(env_id_for(code_hash("x = 1")))
    32
    """
    return hashlib.sha256(f"spade-env\x00{digest}".encode()).hexdigest()[:32]
