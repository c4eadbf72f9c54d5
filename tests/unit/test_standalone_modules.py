"""Modules the image runs as lone files (the Dockerfile copies them to /tmp and runs them before the
project is installed: the model's conversion, the designer's corpus) import nothing of the project at
module level. A project import there passes every other test and breaks only the image build."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LONE_FILES = re.findall(r"^COPY (\S+\.py) /tmp/", (ROOT / "Dockerfile").read_text(), re.MULTILINE)


def _module_level_imports(tree: ast.Module) -> list[str]:
    """Roots of the imports run when the module loads (not those inside a function)."""
    roots = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            node.body = []  # a function's imports run only when called
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.append(node.module.split(".")[0])
    return roots


def test_the_dockerfile_runs_lone_files() -> None:
    assert set(LONE_FILES) == {"spade/inference/models.py", "services/designer/corpus/builder.py"}


@pytest.mark.parametrize("path", LONE_FILES)
def test_a_lone_file_imports_nothing_of_the_project_at_module_level(path: str) -> None:
    roots = _module_level_imports(ast.parse((ROOT / path).read_text()))
    assert not {"spade", "services"} & set(roots), f"{path} imports the project at module level: {roots}"


def test_the_corpus_builder_names_the_settings_the_contract_names() -> None:
    from services.designer.corpus.builder import SETTINGS as BUILDER_SETTINGS
    from spade.envs.types import SETTINGS

    assert BUILDER_SETTINGS == SETTINGS
