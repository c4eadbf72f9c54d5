"""Checkpoints and weight files: atomic directories of HF safetensors, optimizer and learner state.

A checkpoint is ``<root>/step-<N>/`` holding ``model/`` (``save_pretrained`` safetensors + config +
the base checkpoint's tokenizer files), ``optimizer.pt``, ``rng.pt`` and ``state.json`` (the
learner's curriculum state: window accumulators, pending designer samples, buffered plays,
counters). It is written under a temporary name and renamed into place, so a crash leaves either
the whole checkpoint or none of it; a retention policy keeps the newest ``keep``.

Under FSDP2 the full state dicts are gathered collectively (every rank must call ``save``/
``write_weights``); rank 0 alone writes.

Writing a weight version is on the learner's critical path (every ``publish_every`` steps), so it
copies nothing it need not: an unsharded model's state is its own tensors (no gather, no copy), the
safetensors file is written straight from them, and the tokenizer files are hard-linked from the
base checkpoint. Every file and the directory are fsynced before the rename, so a crash of the
machine never leaves a renamed directory with torn files.

A checkpoint's optimizer state (twice the model in fp32: 1.1 GB for the default model) is read back only
on resume, so it is written past the page cache (:func:`save_uncached`).
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import re
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from services.learner.distributed import World
from spade.serving.logs import get_logger

logger = get_logger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read (the message says which and why)."""


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` through a temporary file, fsync and rename (never a torn file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _full_options() -> StateDictOptions:
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def full_model_state(model: nn.Module) -> dict[str, Any]:
    """The unsharded model state dict on CPU (a collective under FSDP2).

    An unsharded model on CPU gives its own tensors (detached, not copied): use the result before
    the next optimiser step changes them.
    """
    if not _sharded(model) and all(t.device.type == "cpu" for t in model.state_dict().values()):
        return {k: v.detach() for k, v in model.state_dict().items()}
    return get_model_state_dict(model, options=_full_options())


def save_model_files(model: nn.Module, state: dict[str, Any], directory: Path) -> None:
    """Write ``state`` as ``model``'s Hugging Face checkpoint files (safetensors + config) into ``directory``.

    Written straight from the tensors with ``safetensors`` (tied duplicates dropped, as
    ``save_pretrained`` does); a model whose checkpoint layout differs from its module layout
    (transformers' weight conversions, e.g. fused MoE experts) goes through ``save_pretrained``,
    which reverts them.
    """
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import extract_weight_conversions_for_model
    from transformers.modeling_utils import remove_tied_weights_from_state_dict
    from transformers.utils import logging as hf_logging

    if not isinstance(model, PreTrainedModel):
        raise CheckpointError(f"{type(model).__name__} is not a transformers model; the learner trains HF models")
    directory.mkdir(parents=True, exist_ok=True)
    if extract_weight_conversions_for_model(model) is not None:
        hf_logging.disable_progress_bar()
        model.save_pretrained(str(directory), state_dict=state, safe_serialization=True)
        return
    from safetensors.torch import save_file

    tensors = remove_tied_weights_from_state_dict(dict(state), model)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"), {"format": "pt"})
    config = model.config
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    dtypes = {v.dtype for v in tensors.values() if v.is_floating_point()}
    if len(dtypes) == 1:
        config.dtype = str(dtypes.pop()).removeprefix("torch.")
    config.save_pretrained(str(directory))
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate():
        generation.save_pretrained(str(directory))


UNCACHED_BUFFER_BYTES = 32 << 20
"""The page-aligned buffer :func:`save_uncached` gathers whole blocks in before each write."""


def save_uncached(obj: Any, path: Path, *, buffer_bytes: int = UNCACHED_BUFFER_BYTES) -> bool:
    """``torch.save(obj)`` into ``path`` past the page cache (``O_DIRECT``); returns whether it was. The caller
    fsyncs it (the checkpoint's :func:`fsync_tree`), as it does every other file of the checkpoint.

    Written through the cache, each checkpoint's optimizer state took 1.1 GB of fresh cache pages while
    the learner waited. On the AMD EPYC VMs this project is measured on, freed memory goes back to the host
    (the balloon's free page reporting), so every fresh page faults on the host: inside a default run
    ``torch.save`` wrote the default model's state in 2.7-3.5 s and its fsync took 0.3-0.4 s, against
    0.8-0.9 s in all this way. Elsewhere it keeps a file read only on resume out of the page
    cache. The bytes are those of ``torch.save`` into a file object.

    Where the platform has no ``O_DIRECT``, or the filesystem or the device refuses it (``EINVAL``, at the
    open or at a write), the file is written again from the start through the cache.
    """
    refused = _save_direct(obj, path, buffer_bytes)
    if refused is None:
        return True
    logger.info("writing %s through the page cache: %s", path, refused)
    with open(path, "wb") as fh:  # a file object, not the path: the same bytes either way
        torch.save(obj, fh)
    return False


def _save_direct(obj: Any, path: Path, buffer_bytes: int) -> OSError | None:
    """:func:`save_uncached`'s ``O_DIRECT`` write; returns the refusal (``EINVAL``) instead of raising it."""
    direct = getattr(os, "O_DIRECT", None)
    if direct is None:
        return OSError(errno.EINVAL, "this platform has no O_DIRECT")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o666)
    except OSError as error:
        if error.errno == errno.EINVAL:
            return error
        raise
    try:
        writer = _DirectWriter(fd, buffer_bytes)
    except BaseException:
        os.close(fd)
        raise
    try:
        torch.save(obj, writer)  # type: ignore[arg-type]  # a writable file object, all torch needs
        writer.finish()
    except OSError as error:
        if error.errno == errno.EINVAL:  # an alignment or a block size the device refuses
            return error
        raise
    finally:
        writer.close()
    return None


class _DirectWriter:
    """A file opened with ``O_DIRECT``, written whole blocks at a time from one page-aligned buffer (what
    ``O_DIRECT`` asks of the memory, the offsets and the lengths); the last block's padding is cut off.

    A write the system refuses is kept in :attr:`error` and raised by :meth:`finish`, the data after it
    dropped: raised inside ``torch.save``, it would leave torch's archive writer out of step, and torch
    would report that instead.
    """

    def __init__(self, fd: int, buffer_bytes: int) -> None:
        self.fd = fd
        self.block = max(4096, os.fstat(fd).st_blksize)
        self.buffer = mmap.mmap(-1, max(self.block, buffer_bytes // self.block * self.block))
        self.view = memoryview(self.buffer)
        self.filled = 0
        self.size = 0  # bytes taken so far: the file's size once finished
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        source = memoryview(data).cast("B")
        taken = 0
        while taken < len(source) and self.error is None:
            count = min(len(source) - taken, len(self.buffer) - self.filled)
            self.view[self.filled : self.filled + count] = source[taken : taken + count]
            self.filled += count
            taken += count
            if self.filled == len(self.buffer):
                self._write_blocks(self.filled)
        self.size += len(source)
        return len(source)

    def flush(self) -> None:
        """Nothing to do: whole blocks go out as the buffer fills, the rest in :meth:`finish`."""

    def _write_blocks(self, end: int) -> None:
        done = 0
        try:
            while done < end:
                chunk = self.view[done:end]
                try:
                    done += os.write(self.fd, chunk)
                finally:
                    chunk.release()  # else a traceback holding it keeps the buffer from closing
        except OSError as error:
            self.error = error
        self.filled = 0

    def finish(self) -> None:
        """Write what is left (padded to a whole block) and cut the file to its size.

        Raises:
            OSError: The first write the system refused.
        """
        if self.filled and self.error is None:
            end = -(-self.filled // self.block) * self.block
            self.view[self.filled : end] = bytes(end - self.filled)
            self._write_blocks(end)
        if self.error is not None:
            raise self.error
        os.ftruncate(self.fd, self.size)

    def close(self) -> None:
        try:
            self.view.release()
            self.buffer.close()
        finally:
            os.close(self.fd)


def link_tokenizer_files(base_model_dir: Path | None, directory: Path) -> None:
    """Hard-link the base checkpoint's tokenizer files into ``directory`` (copy across filesystems)."""
    if base_model_dir is None:
        return
    for name in TOKENIZER_FILES:
        src, dst = base_model_dir / name, directory / name
        if src.is_file() and not dst.exists():
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """fsync every file of ``directory`` (not recursing), then the directory itself."""
    for entry in directory.iterdir():
        if entry.is_file():
            _fsync(entry)
    _fsync(directory)


def install(tmp: Path, target: Path) -> None:
    """Rename the finished ``tmp`` directory to ``target`` (replacing it) and fsync the parent."""
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    _fsync(target.parent)


def write_weights(
    model: nn.Module, target: Path, *, base_model_dir: Path | None, world: World = World()
) -> Path | None:
    """Write the model as a Hugging Face checkpoint directory, atomically (collective under FSDP2).

    ``target`` appears complete (and durable) or not at all; tokenizer files are linked from
    ``base_model_dir``. Returns ``target`` on rank 0, ``None`` elsewhere.
    """
    state = full_model_state(model)
    if not world.is_main:
        return None
    tmp = staging_dir(target)
    try:
        save_model_files(model, state, tmp)
        link_tokenizer_files(base_model_dir, tmp)
        fsync_tree(tmp)
        install(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def copy_weights(source: Path, target: Path) -> Path:
    """Install a copy of the weight files of ``source`` (a checkpoint's ``model/``) as ``target``, atomically.

    Files are hard-linked where the filesystem allows (they are never modified in place).
    """
    tmp = staging_dir(target)
    try:
        shutil.copytree(source, tmp, copy_function=_link_or_copy)
        fsync_tree(tmp)
        install(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def staging_dir(target: Path) -> Path:
    """A fresh temporary directory beside ``target`` (same filesystem, so the rename is atomic)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    return target.parent / f".tmp-{target.name}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class Restored:
    """What ``load`` brought back."""

    step: int
    path: Path
    state: dict[str, Any]


class CheckpointManager:
    """Atomic, retained checkpoints under one root directory.

    Args:
        root: Directory of ``step-<N>`` checkpoints (created on demand).
        keep: How many of the newest checkpoints to retain (>= 1).
        base_model_dir: Where tokenizer files are copied from.
        world: The process group.
    """

    def __init__(self, root: Path, keep: int = 3, *, base_model_dir: Path | None = None, world: World = World()):
        if keep < 1:
            raise CheckpointError(f"checkpoint retention must keep at least 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self.base_model_dir = base_model_dir
        self.world = world

    def path(self, step: int) -> Path:
        """Directory of checkpoint ``step``."""
        return self.root / f"step-{step:08d}"

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, oldest first."""
        if not self.root.is_dir():
            return []
        found = (_STEP_DIR.match(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def latest(self) -> int | None:
        """The newest complete checkpoint's step, if any."""
        steps = self.steps()
        return steps[-1] if steps else None

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any],
        *,
        model_files: Path | None = None,
    ) -> Path | None:
        """Write checkpoint ``step`` atomically, then apply retention (collective under FSDP2).

        ``model_files``: a weight directory (:func:`write_weights`) just written from this same model
        (the version published at this step); its files are hard-linked into the checkpoint instead
        of written again. Every rank must pass the same (``None`` makes the write collective).

        Returns its path on rank 0, ``None`` on other ranks.
        """
        optim_state = get_optimizer_state_dict(model, optimizer, options=_full_options())
        target = self.path(step)
        staged = self.root / f".model-{step:08d}"
        if model_files is not None:
            tmp_model = copy_weights(model_files, staged) if self.world.is_main else None
        else:
            tmp_model = write_weights(model, staged, base_model_dir=self.base_model_dir, world=self.world)
        if not self.world.is_main:
            return None
        assert tmp_model is not None
        tmp = self.root / f".tmp-step-{step:08d}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir(parents=True)
            os.replace(tmp_model, tmp / "model")
            save_uncached(optim_state, tmp / "optimizer.pt")
            torch.save({"torch": torch.get_rng_state()}, tmp / "rng.pt")
            write_json_atomic(tmp / "state.json", {"step": step, **state})
            fsync_tree(tmp)
            install(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(tmp_model, ignore_errors=True)
            raise
        self._retain()
        return target

    def update_state(self, step: int, state: dict[str, Any]) -> Path:
        """Replace checkpoint ``step``'s learner state, keeping its model and optimizer (rank 0).

        For a checkpoint of a version that has not trained further (on SIGTERM): the state file is
        replaced atomically, so the checkpoint is whole before and after.

        Raises:
            CheckpointError: There is no checkpoint ``step``.
        """
        path = self.path(step)
        if not path.is_dir():
            raise CheckpointError(f"no checkpoint at {path} to update; available steps: {self.steps()}")
        write_json_atomic(path / "state.json", {"step": step, **state})
        return path

    def _retain(self) -> None:
        for step in self.steps()[: -self.keep]:
            shutil.rmtree(self.path(step), ignore_errors=True)
        for leftover in self.root.glob(".tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int | None = None) -> Restored | None:
        """Load checkpoint ``step`` (default: the newest) into ``model`` and ``optimizer``.

        Every rank reads the files (they are on a shared filesystem in multi-node setups).
        Returns ``None`` when there is no checkpoint.
        """
        step = self.latest() if step is None else step
        if step is None:
            return None
        path = self.path(step)
        if not path.is_dir():
            raise CheckpointError(f"no checkpoint at {path}; available steps: {self.steps()}")
        from safetensors.torch import load_file

        model_state: dict[str, Any] = {}
        for shard in sorted((path / "model").glob("*.safetensors")):
            model_state.update(load_file(str(shard)))
        if not model_state:
            raise CheckpointError(f"checkpoint {path} holds no safetensors weights")
        # Tied weights are stored once (save_pretrained drops the duplicates): every other name of
        # the same parameter takes the stored tensor.
        names_of: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(param), []).append(name)
        for names in names_of.values():
            stored = next((n for n in names if n in model_state), None)
            if stored is not None:
                for name in names:
                    model_state.setdefault(name, model_state[stored])
        expected = set(get_model_state_dict(model, options=_full_options()))
        missing = sorted(expected - set(model_state))
        if missing:
            raise CheckpointError(f"checkpoint {path} lacks {len(missing)} tensors of the model, e.g. {missing[:5]}")
        set_model_state_dict(model, model_state, options=StateDictOptions(full_state_dict=True))
        optim_state = torch.load(path / "optimizer.pt", weights_only=False)
        set_optimizer_state_dict(model, optimizer, optim_state, options=StateDictOptions(full_state_dict=True))
        rng = torch.load(path / "rng.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        state = json.loads((path / "state.json").read_text())
        return Restored(step=step, path=path, state=state)
