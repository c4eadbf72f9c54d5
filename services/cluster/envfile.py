"""The env files the process runner (and compose) read: ``KEY=VALUE`` lines with ``${VAR}`` references.

Rules, the same as docker compose's ``.env`` for what the file uses:

- one ``KEY=VALUE`` per line; blank lines and lines starting with ``#`` are ignored; an ``export ``
  prefix is allowed; a value may be wrapped in single or double quotes (kept verbatim inside);
- ``${NAME}`` and ``${NAME:-default}`` in an unquoted or double-quoted value expand from the process
  environment first, then from the lines above; single-quoted values are not expanded;
- a variable already set in the process environment wins over the file's line for it (so
  ``SPADE_LOCAL_MEMORY_GRPC_PORT=60052 spade cluster up`` moves the memory, and every address the
  file builds from that variable follows);
- several files are read in order (``deploy/spade.env``, the settings compose shares, then
  ``deploy/local.env``, the addresses of processes): a later file's line wins over an earlier one's
  and may refer to it.

>>> parse_env_lines(["A=1", "B=${A}0", "C='${A}'", "D=${MISSING:-x}"], {})
{'A': '1', 'B': '10', 'C': '${A}', 'D': 'x'}
>>> parse_env_lines(["A=1", "B=${A}0"], {"A": "7"})
{'A': '7', 'B': '70'}
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

#: The env files ``spade cluster`` reads, in order, relative to the repository root: the settings
#: compose shares (its env_file), then the addresses of the processes.
DEFAULT_ENV_FILES = (Path("deploy/spade.env"), Path("deploy/local.env"))

_LINE = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.*?)\s*$")
_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class EnvFileError(ValueError):
    """A line of the env file cannot be read; the message names the file, the line and the fix."""


def parse_env_lines(
    lines: Iterable[str],
    environ: Mapping[str, str],
    *,
    source: str = "env file",
    above: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The variables ``lines`` define, expanded, with ``environ`` winning for variables it sets.

    ``above`` holds what earlier files defined: references may name it, and the result keeps it
    under what these lines define.
    """
    values: dict[str, str] = dict(above or {})
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            raise EnvFileError(f"{source}:{number}: expected KEY=VALUE, got {line[:60]!r}")
        key, value = match.groups()
        if key in environ:
            values[key] = environ[key]
            continue
        if len(value) >= 2 and value[0] == value[-1] == "'":
            values[key] = value[1:-1]
            continue
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]

        def expand(ref: re.Match[str], number: int = number) -> str:
            name, default = ref.group(1), ref.group(2)
            found = environ.get(name, values.get(name))
            if found is None:
                if default is None:
                    raise EnvFileError(
                        f"{source}:{number}: ${{{name}}} is not set above this line nor in the environment; "
                        f"define it first or write ${{{name}:-default}}"
                    )
                return default
            return found

        values[key] = _REF.sub(expand, value)
    return values


def read_env_files(paths: Sequence[Path], environ: Mapping[str, str]) -> dict[str, str]:
    """:func:`parse_env_lines` of each file in order, a later file's lines over an earlier one's.

    Raises:
        EnvFileError: A file cannot be read or a line is malformed.
    """
    values: dict[str, str] = {}
    for path in paths:
        try:
            text = path.read_text()
        except OSError as exc:
            raise EnvFileError(f"cannot read the env file {path} ({exc.strerror or exc}); pass --env-file") from None
        values = parse_env_lines(text.splitlines(), environ, source=str(path), above=values)
    return values
