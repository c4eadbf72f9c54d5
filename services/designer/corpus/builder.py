"""Build the default offline corpus from documentation shipped in installed packages.

- ``game``: docstrings of sympy, scipy, numpy and networkx (math and science; about 9k documents, most
  with runnable ``>>>`` examples).
- ``tool``: docstrings of the Python standard library.

Nothing is downloaded. The builder walks each package's public modules (names without a leading
underscore, no test packages), collects the docstrings of public functions, classes, their public
methods and other public callables, skips short ones and dedupes by object and by text. Output is
sorted by qualified name, so the same package versions give the same file.

The corpus is cached as ``<cache_dir>/<setting>.jsonl`` with a ``<setting>.meta.json`` recording the
package versions; ``ensure_default_corpus`` rebuilds it lazily (in a subprocess, so the designer
does not keep scipy and sympy imported) when it is missing or the versions changed.

Run ``python -m services.designer.corpus.builder [--setting game|tool] [--cache-dir DIR]`` or
``spade designer build-corpus``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.metadata
import inspect
import io
import json
import logging
import os
import pkgutil
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

# No project imports at module level: the image builds the corpus from this file alone (Dockerfile);
# tests/unit/test_standalone_modules.py keeps it so. Hence the settings' names spelled out here.
SETTINGS = ("game", "tool")

log = logging.getLogger("spade.designer.corpus.builder")

BUILDER_VERSION = 2
GAME_PACKAGES = ("sympy", "scipy", "numpy", "networkx")
MIN_WORDS = 30

# Parts of module paths never walked: tests, build tooling, and modules with side effects on import.
_SKIP_PARTS = frozenset({"tests", "test", "testing", "conftest", "benchmarks", "setup", "conftests", "_pytest", "f2py"})
_SKIP_STDLIB = frozenset(
    {
        "antigravity",  # opens a web browser
        "this",  # prints on import
        "idlelib",
        "tkinter",
        "turtle",
        "turtledemo",
        "test",
        "ensurepip",
        "lib2to3",
        "pydoc_data",
        "__hello__",
        "__phello__",
        "xxsubtype",
        "xxlimited",
        "xxlimited_35",
        "_xxtestfuzz",
        "msilib",
        "winreg",
        "winsound",
        "msvcrt",
        "nt",
        "_winapi",
    }
)


def default_cache_dir() -> Path:
    """``$SPADE_CORPUS_DIR``, else ``$XDG_CACHE_HOME/spade/corpus``, else ``~/.cache/spade/corpus``."""
    if os.environ.get("SPADE_CORPUS_DIR"):
        return Path(os.environ["SPADE_CORPUS_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "spade" / "corpus"


def stdlib_packages() -> tuple[str, ...]:
    """Public top-level standard-library modules worth documenting for the tool setting."""
    names = sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in _SKIP_STDLIB)
    return tuple(names)


def packages_for(setting: str) -> tuple[str, ...]:
    """The packages whose docstrings make up ``setting``'s default corpus."""
    if setting == "game":
        return GAME_PACKAGES
    if setting == "tool":
        return stdlib_packages()
    raise ValueError(f"unknown setting {setting!r}: expected 'game' or 'tool'")


def package_versions(packages: Iterable[str]) -> dict[str, str]:
    """Installed version of each top-level package (the Python version for stdlib modules)."""
    versions = {}
    for name in packages:
        if name in sys.stdlib_module_names:
            versions[name] = f"python-{sys.version_info.major}.{sys.version_info.minor}"
            continue
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "missing"
    return versions


@dataclass(frozen=True)
class DocEntry:
    """One documented object."""

    name: str
    package: str
    text: str

    def to_json(self) -> str:
        return json.dumps({"text": self.text, "name": self.name, "package": self.package}, ensure_ascii=False)


def _public(name: str) -> bool:
    return not name.startswith("_")


def iter_modules(package: str) -> Iterator[ModuleType]:
    """Import ``package`` and its public submodules (those that import cleanly), in sorted order."""
    root = _quiet_import(package)
    if root is None:
        return
    yield root
    path = getattr(root, "__path__", None)
    if path is None:
        return
    names: set[str] = set()
    with _quiet():
        walker = pkgutil.walk_packages(path, package + ".", onerror=lambda _name: None)
        for info in walker:
            parts = info.name.split(".")[1:]
            if all(_public(p) and p not in _SKIP_PARTS for p in parts):
                names.add(info.name)
    for name in sorted(names):
        module = _quiet_import(name)
        if module is not None:
            yield module


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # Importing hundreds of modules prints deprecation warnings (and some modules print).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield


def _quiet_import(name: str) -> ModuleType | None:
    try:
        with _quiet():
            return importlib.import_module(name)
    except BaseException as error:  # a module may raise anything, even SystemExit, on import
        if isinstance(error, KeyboardInterrupt):
            raise
        log.debug("skipping %s: %s", name, error)
        return None


def _doc_of(obj: object) -> str:
    try:
        doc = obj.__doc__ if isinstance(obj, (staticmethod, classmethod)) else inspect.getdoc(obj)
    except Exception:
        return ""
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")


def _signature(obj: object) -> str:
    """``obj``'s signature, without the memory addresses of default values (``<function f at 0x7f..>``).

    The corpus must come out the same on every build: the warm start's cache key hashes it, and a
    designer prompt must not depend on where a process happened to put an object.
    """
    try:
        text = str(inspect.signature(obj))  # type: ignore[arg-type]
    except Exception:  # signatures of C callables may fail in many ways
        return ""
    return _ADDRESS.sub(">", text)


def _members(module: ModuleType) -> Iterator[tuple[str, object]]:
    names = getattr(module, "__all__", None)
    if not isinstance(names, (list, tuple)):
        names = [n for n in dir(module) if _public(n)]
    for name in sorted({str(n) for n in names}):
        if not _public(name):
            continue
        try:
            yield name, getattr(module, name)
        except Exception:
            continue


def collect(packages: Iterable[str], *, min_words: int = MIN_WORDS) -> list[DocEntry]:
    """Docstrings of the public callables of ``packages``, deduped and sorted by name.

    Args:
        packages: Importable module or package names (``"networkx"``, ``"networkx.algorithms.clique"``).
        min_words: Docstrings shorter than this are skipped.
    """
    seen_objects: set[int] = set()
    seen_texts: set[str] = set()
    entries: list[DocEntry] = []

    def add(qualified: str, package: str, obj: object, doc: str) -> None:
        if len(doc.split()) < min_words:
            return
        digest = hashlib.sha1(doc.encode("utf-8")).hexdigest()
        if digest in seen_texts:
            return
        seen_texts.add(digest)
        title = f"{qualified}{_signature(obj)}"
        entries.append(DocEntry(name=qualified, package=package, text=f"{title}\n\n{doc}"))

    keep: list[object] = []  # keep objects alive so id() stays unique while collecting
    with _quiet():
        # Reading every public name of numpy, scipy, ... touches their deprecated aliases, and each
        # warns: hundreds of lines about code this project does not use, on a newcomer's first screen.
        _collect_into(packages, seen_objects, keep, add)
    entries.sort(key=lambda e: e.name)
    return entries


def _collect_into(
    packages: Iterable[str],
    seen_objects: set[int],
    keep: list[object],
    add: Callable[[str, str, object, str], None],
) -> None:
    for package in packages:
        for module in iter_modules(package):
            module_doc = _doc_of(module)
            if id(module) not in seen_objects:
                seen_objects.add(id(module))
                keep.append(module)
                add(module.__name__, package, module, module_doc)
            for name, obj in _members(module):
                if inspect.ismodule(obj) or not callable(obj) or id(obj) in seen_objects:
                    continue
                seen_objects.add(id(obj))
                keep.append(obj)
                qualified = f"{module.__name__}.{name}"
                add(qualified, package, obj, _doc_of(obj))
                if inspect.isclass(obj):
                    for attr, member in sorted(vars(obj).items()):
                        target = getattr(member, "__func__", member)
                        if not _public(attr) or id(target) in seen_objects:
                            continue
                        if not (callable(target) or isinstance(member, property)):
                            continue
                        seen_objects.add(id(target))
                        keep.append(target)
                        add(f"{qualified}.{attr}", package, target, _doc_of(target))


def write_corpus(entries: list[DocEntry], path: Path, *, meta: dict[str, object]) -> None:
    """Write ``entries`` as JSONL to ``path`` atomically, with ``meta`` beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as handle:
        for entry in entries:
            handle.write(entry.to_json() + "\n")
    os.replace(tmp, path)
    meta_path = path.with_suffix(".meta.json")
    meta_tmp = meta_path.with_suffix(f".tmp{os.getpid()}")
    meta_tmp.write_text(json.dumps(meta, indent=2, sort_keys=True), encoding="utf-8")
    os.replace(meta_tmp, meta_path)


def corpus_meta(setting: str, packages: Iterable[str], documents: int | None = None) -> dict[str, object]:
    """What a built corpus records about itself (compared to decide whether to rebuild)."""
    packages = tuple(packages)
    meta: dict[str, object] = {
        "builder_version": BUILDER_VERSION,
        "setting": setting,
        "versions": package_versions(packages),
    }
    if documents is not None:
        meta["documents"] = documents
    return meta


def build_corpus(setting: str, cache_dir: Path | None = None, *, packages: Iterable[str] | None = None) -> Path:
    """Build ``setting``'s corpus in this process and write it to ``<cache_dir>/<setting>.jsonl``.

    Args:
        setting: ``"game"`` or ``"tool"``.
        cache_dir: Where to write (default ``default_cache_dir()``).
        packages: Override the packages (tests build a small subset).

    Returns:
        The path of the JSONL file.
    """
    packages = tuple(packages) if packages is not None else packages_for(setting)
    cache_dir = cache_dir or default_cache_dir()
    entries = collect(packages)
    if not entries:
        raise RuntimeError(f"no documentation found in {', '.join(packages)}: are the packages installed?")
    path = cache_dir / f"{setting}.jsonl"
    write_corpus(entries, path, meta=corpus_meta(setting, packages, len(entries)))
    log.info("built the %s corpus: %d documents in %s", setting, len(entries), path)
    return path


def is_current(setting: str, cache_dir: Path) -> bool:
    """Whether ``cache_dir`` holds a corpus built by this builder from the installed package versions."""
    path = cache_dir / f"{setting}.jsonl"
    meta_path = path.with_suffix(".meta.json")
    if not path.is_file() or not meta_path.is_file():
        return False
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    expected = corpus_meta(setting, packages_for(setting))
    return all(meta.get(key) == value for key, value in expected.items())


def ensure_default_corpus(setting: str, cache_dir: Path | None = None, *, timeout_s: float = 600.0) -> Path:
    """The cached default corpus of ``setting``, built first (in a subprocess) when missing or stale.

    Raises:
        RuntimeError: The build failed; the message carries the builder's last error lines.
    """
    cache_dir = cache_dir or default_cache_dir()
    path = cache_dir / f"{setting}.jsonl"
    if is_current(setting, cache_dir):
        return path
    log.info("building the default %s corpus in %s (first use; takes a few seconds)", setting, cache_dir)
    command = [sys.executable, "-m", "services.designer.corpus.builder", "--setting", setting]
    command += ["--cache-dir", str(cache_dir)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0 or not path.is_file():
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise RuntimeError(
            f"building the default {setting} corpus failed (exit {done.returncode}): {tail}; "
            "run `python -m services.designer.corpus.builder` to see the full error, "
            "or pass your own JSONL corpus"
        )
    return path


def main(argv: list[str] | None = None) -> int:
    """Command line entry: build one or both default corpora."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--setting", choices=[*SETTINGS, "all"], default="all")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument(
        "--force", action="store_true", help="Rebuild even when the cached corpus is current (same packages)."
    )
    args = parser.parse_args(argv)
    try:
        from spade.serving.logs import configure_from_env
    except ImportError:  # run as a lone file (the image's corpus layer): its output is discarded there
        logging.basicConfig(level=logging.INFO)
    else:
        configure_from_env("corpus", level=logging.INFO, default_format="text")
    settings = list(SETTINGS) if args.setting == "all" else [args.setting]
    for setting in settings:
        # A current corpus is kept as it is: a rebuild would change nothing but the file's age, and a
        # re-install (make, after pyproject.toml changes) must not invalidate what hashes it.
        current = not args.force and is_current(setting, args.cache_dir or default_cache_dir())
        path = (args.cache_dir or default_cache_dir()) / f"{setting}.jsonl" if current else None
        print(path or build_corpus(setting, args.cache_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
