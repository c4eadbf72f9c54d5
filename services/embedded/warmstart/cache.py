"""The warm-started designer checkpoint, built once and cached like the converted model.

The checkpoint lives in ``<model cache>/<base-name>-warm-<key>/`` (the model cache is
``$SPADE_MODEL_CACHE`` or ``~/.cache/spade/models``), where ``key`` hashes everything the trained
weights depend on: the base checkpoint's files, the families' sources, the designer's prompt code
and example envs, the corpus file, this package's pair and SFT code, and the settings that shape
pairs and training (``WarmStartSettings.key_fields``). Change any of them and a new checkpoint is
built; nothing else rebuilds it.

It is written atomically: built in a temporary directory beside the target and renamed into place
with ``warmstart.json`` (pairs built and valid, steps, epochs, the loss curve, the loss before and
after on probe pairs, the wall time, the before/after evaluation) written last. Two processes may
build at once; the first rename wins.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from services.embedded.warmstart.settings import WarmStartSettings
from spade.serving.logs import get_logger

log = get_logger(__name__)

Progress = Callable[[str, float, float], None]
"""``progress(phase, done, total)``: ``pairs``, ``eval base``, ``loss``, ``train``, ``eval warm``."""

RECORD = "warmstart.json"
"""Written last into a finished warm start: a directory without it is not one."""
_ROOT = Path(__file__).resolve().parents[3]
_PROMPT_SOURCES = ("services/designer/core/prompts.py", "services/designer/core/skills.py")
_OWN_SOURCES = ("services/embedded/warmstart/data.py", "services/embedded/warmstart/train.py")


def _no_progress(phase: str, done: float, total: float) -> None:
    return None


def _digest_files(paths: Iterable[Path], root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(str(path.relative_to(root)).encode() + b"\x00")
        with path.open("rb") as handle:
            digest.update(hashlib.file_digest(handle, "sha256").digest())
    return digest.hexdigest()


def families_digest(root: Path | None = None) -> str:
    """SHA-256 over the sources of ``spade/envs/families`` (file names and contents)."""
    from spade.envs import families

    folder = root or Path(families.__file__).resolve().parent
    return _digest_files(folder.rglob("*.py"), folder)


def model_digest(model_dir: Path) -> str:
    """SHA-256 over a checkpoint's config and weight files (its content, wherever it lives)."""
    files = [model_dir / "config.json", *model_dir.glob("*.safetensors")]
    return _digest_files([f for f in files if f.is_file()], model_dir)


def source_digest() -> str:
    """SHA-256 over the designer's prompt code, the example envs and this package's pair and SFT code."""
    from spade.envs import examples

    folder = Path(examples.__file__).resolve().parent
    paths = [_ROOT / p for p in (*_PROMPT_SOURCES, *_OWN_SOURCES)]
    return _digest_files(paths, _ROOT) + _digest_files(folder.glob("*.py"), folder)


def cache_key(settings: WarmStartSettings, *, model: str, families: str, sources: str, corpus: str) -> str:
    """The 12-hex-digit key of a warm start from its inputs' digests and settings.

    >>> s = WarmStartSettings()
    >>> a = cache_key(s, model="m", families="f", sources="s", corpus="c")
    >>> a == cache_key(s, model="m", families="f2", sources="s", corpus="c")
    False
    >>> a == cache_key(s.model_copy(update={"evaluate": False}), model="m", families="f", sources="s", corpus="c")
    True
    """
    payload = {
        "model": model,
        "families": families,
        "sources": sources,
        "corpus": corpus,
        "settings": settings.key_fields(),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:12]


def corpus_file(settings: WarmStartSettings) -> Path:
    """The corpus the prompts come from: ``settings.corpus_path`` or the built-in one (built on first use)."""
    from services.designer.corpus.builder import ensure_default_corpus

    return settings.corpus_path or ensure_default_corpus(settings.setting)


def warm_start_dir(settings: WarmStartSettings) -> Path:
    """Where the warm start of ``settings`` lives (whether or not it is built yet)."""
    from spade.inference.models import model_cache_dir, resolve_model_path

    base = resolve_model_path(settings.model_path)
    key = cache_key(
        settings,
        model=model_digest(base),
        families=families_digest(),
        sources=source_digest(),
        corpus=_digest_files([corpus_file(settings)], corpus_file(settings).parent),
    )
    return (settings.cache_dir or model_cache_dir()) / f"{base.name}-warm-{key}"


def read_record(directory: Path) -> dict[str, Any] | None:
    """The ``warmstart.json`` of a finished warm start, or ``None``."""
    path = directory / RECORD
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def ensure_warm_start(settings: WarmStartSettings, *, progress: Progress | None = None, force: bool = False) -> Path:
    """The warm-started designer checkpoint of ``settings``: the cached one, or built now.

    For synchronous callers (``spade warmstart``); inside a running event loop (``spade run``'s
    runner) ``await warm_start(...)`` instead.

    Args:
        settings: What to build (``WarmStartSettings.from_run(run_settings)`` for the embedded run:
            its ``model_path`` is the *base* model; a warm start of a warm start is another key).
        progress: ``progress(phase, done, total)`` as pairs are validated, steps taken, answers judged.
        force: Rebuild even when a cached one exists.

    Returns:
        A checkpoint directory usable as ``model_path`` (weights, config, tokenizer, ``warmstart.json``).
        A cached one without an evaluation gets one first when ``settings.evaluate`` is on.

    Raises:
        WarmStartError: No pair passed validation (nothing to train on).
    """
    return asyncio.run(warm_start(settings, progress=progress, force=force))


async def warm_start(settings: WarmStartSettings, *, progress: Progress | None = None, force: bool = False) -> Path:
    """``ensure_warm_start`` for a caller with a running event loop (training runs in a worker thread)."""
    progress = progress or _no_progress
    target = await asyncio.to_thread(warm_start_dir, settings)  # hashes the base model's files
    record = read_record(target)
    if record is not None and not force:
        if settings.evaluate and not record.get("evaluation"):
            record["evaluation"] = await _evaluate_cached(settings, target, record, progress)
            _write_record(target, record)
        log.info("warm start cached at %s", target)
        return target
    if target.exists():
        _remove(target)
    from services.embedded.warmstart.build import build

    target.parent.mkdir(parents=True, exist_ok=True)
    _sweep_staging(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}.", dir=target.parent))
    try:
        record = await build(settings, staging, progress)
        record["directory"] = str(target)
        _write_record(staging, record)
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is readable like any other
        try:
            staging.rename(target)
        except OSError:
            if read_record(target) is None:
                raise
            shutil.rmtree(staging, ignore_errors=True)  # another process finished first
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


async def _evaluate_cached(
    settings: WarmStartSettings, target: Path, record: dict[str, Any], progress: Progress
) -> dict[str, Any]:
    from services.embedded.warmstart.build import evaluate_pair

    return await evaluate_pair(settings, target, frozenset(record.get("training_digests", ())), progress)


def _sweep_staging(target: Path) -> None:
    """Remove staging directories of ``target`` whose builder died (killed before it could clean up).

    A staging directory is ``.<name>.<pid>.<random>``; one whose process is gone holds up to a
    model's worth of half-written files that nobody will finish.
    """
    for staging in target.parent.glob(f".{target.name}.*"):
        pid = staging.name.removeprefix(f".{target.name}.").split(".", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        log.info("removing %s, left by a warm start that did not finish (process %s is gone)", staging, pid)
        shutil.rmtree(staging, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_record(directory: Path, record: dict[str, Any]) -> None:
    tmp = directory / f".{RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
    tmp.replace(directory / RECORD)


def _remove(directory: Path) -> None:
    # Out of the way first (a rename is atomic), then deleted: a reader never sees half of it.
    trash = directory.with_name(f".{directory.name}.old-{time.time_ns()}")
    with contextlib.suppress(FileNotFoundError):
        directory.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)
