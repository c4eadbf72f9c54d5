"""The staging directory: the only project files the sandbox can see.

At start the pool copies the standard-library-only sources the sandbox runs (the env contract library
``spade/envs`` with its examples, and ``services/sandbox/runtime``) into a fresh directory readable by
the sandbox uid, with empty package ``__init__`` files above them. Only that directory is bound
(read-only) into the sandbox, at ``/opt/spade``; nothing else of the checkout is visible inside.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import services.sandbox.runtime as runtime_package

MOUNT_POINT = "/opt/spade"
_EXCLUDE_ENVS = ("gym_adapter.py",)  # imports gymnasium; never used inside the sandbox


def _envs_dir() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("spade.envs")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _copy_tree(source: Path, target: Path, exclude: tuple[str, ...] = ()) -> None:
    target.mkdir(mode=0o755, parents=True, exist_ok=True)
    for item in sorted(source.iterdir()):
        if item.name in exclude or item.name == "__pycache__" or item.name.startswith("."):
            continue
        if item.is_dir():
            _copy_tree(item, target / item.name)
        elif item.is_file() and item.suffix in (".py", ".json", ".txt", ".md"):
            shutil.copyfile(item, target / item.name)
            (target / item.name).chmod(0o644)


def _package(path: Path, doc: str) -> None:
    path.mkdir(mode=0o755, parents=True, exist_ok=True)
    init = path / "__init__.py"
    if not init.exists():
        init.write_text(f'"""{doc}"""\n')
        init.chmod(0o644)


def stage_sources(parent: str | None = None) -> Path:
    """Copy the sandbox's sources into a fresh world-readable directory and return it.

    Args:
        parent: directory to create it in (default: the system temp dir).
    """
    # The service's pid in the name tells whose sandbox a process belongs to (ps, tests).
    root = Path(tempfile.mkdtemp(prefix=f"spade-sandbox-{os.getpid()}-", dir=parent))
    root.chmod(0o755)
    _package(root / "spade", "Staged copy: only the env contract library is present.")
    envs = _envs_dir()
    if envs is not None:
        _copy_tree(envs, root / "spade" / "envs", _EXCLUDE_ENVS)
    _package(root / "services", "Staged copy.")
    _package(root / "services" / "sandbox", "Staged copy: only the in-sandbox runtime is present.")
    _copy_tree(Path(runtime_package.__file__).parent, root / "services" / "sandbox" / "runtime")
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root


def remove_staging(root: Path) -> None:
    """Delete a staging directory made by ``stage_sources``."""
    shutil.rmtree(root, ignore_errors=True)
