"""The layering contracts (``[tool.importlinter]`` in pyproject.toml) hold, and they can fail.

``make lint`` runs the same check; this test proves that the contracts are not vacuous: a copy of
the tree with one forbidden import per rule breaks exactly the contract that states the rule.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# lint-imports, run in a subprocess whose working directory (first on sys.path) holds the tree to
# check: grimp finds `spade` and `services` through the import system, so a copy there shadows the
# editable install.
LINT = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"]


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LINT, "--no-cache", "--no-logo", "--config", str(tree / "pyproject.toml")],
        check=False,
        cwd=tree,
        env={**os.environ, "COLUMNS": "500"},  # one line per contract in the report
        capture_output=True,
        text=True,
        timeout=240,
    )


def broken_contracts(output: str) -> dict[str, str]:
    """Each contract the report lists as BROKEN, with the part of the report that explains it."""
    summary, _, details = output.partition("Broken contracts")
    names = [m.group(1) for m in re.finditer(r"^(.+) BROKEN(?: \(.*\))?$", summary, re.MULTILINE)]
    starts = sorted((details.index(f"\n{name}\n"), name) for name in names)
    ends = [at for at, _ in starts[1:]] + [len(details)]
    return {name: details[at:end] for (at, name), end in zip(starts, ends, strict=True)}


def test_the_tree_keeps_every_contract() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


# One forbidden import per contract: (module added to the copy, its source, the contract it breaks).
PROBES = [
    ("spade/probe.py", "import services.memory.service\n", "spade (the foundation) never imports services"),
    (
        "services/designer/probe.py",
        "import services.embedded\n",
        "nothing but a composition root imports services.embedded or services.cluster",
    ),
    (
        "services/learner/probe.py",
        "from services.sandbox.isolation import SandboxPool\n",
        "no service imports another service",
    ),
    ("services/designer/core/probe.py", "import grpc\n", "service cores import no grpc, protobuf, HTTP, SQL or Redis"),
    ("spade/envs/probe.py", "import httpx\n", "the foundation's domain modules import no grpc, HTTP, SQL or Redis"),
]


def test_each_forbidden_import_breaks_its_contract(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in ("spade", "services"):
        shutil.copytree(ROOT / package, tree / package, ignore=skip)
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    for module, source, _ in PROBES:
        (tree / module).write_text(source)

    result = lint_imports(tree)

    assert result.returncode == 1, result.stdout + result.stderr
    broken = broken_contracts(result.stdout)
    assert len(broken) == len(PROBES), result.stdout
    for module, _, contract in PROBES:
        [(name, report)] = [(name, report) for name, report in broken.items() if name.startswith(contract)]
        probe = module.removesuffix(".py").replace("/", ".")
        assert probe in report, f"{name} does not name {probe}:\n{report}"
        others = "".join(r for n, r in broken.items() if n != name)
        assert probe not in others, f"{probe} broke more than {name}:\n{result.stdout}"
