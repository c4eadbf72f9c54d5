"""Structured output: SGLang's ``regex``, ``ebnf`` and ``json_schema`` sampling parameters.

Implemented with xgrammar (SGLang's default grammar backend, ``sglang/srt/constrained/
xgrammar_backend.py``): a request's constraint is compiled once against the served tokenizer (cached
by its text), each sampled sequence gets its own matcher, and before every sampling step the tokens
the grammar does not allow next are masked to ``-inf`` in the logits. As in SGLang, the mask is applied
*before* the sampler, so the reported logprobs are those of the constrained distribution
(``log_softmax(masked_logits / temperature)``; greedy: of the masked logits). When the grammar is
complete only the model's stop tokens remain allowed, so a constrained generation that stops on its
own always matches; one cut by ``max_new_tokens`` is a prefix of a match (SGLang does the same).

Compilation (tens to hundreds of milliseconds for a regex, less when cached) runs off the scheduler
thread, before the request is queued, so a malformed grammar is a 400 and never stalls the batch.
xgrammar is imported on first use: servers that never see a constrained request never load it.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch

from spade.inference.protocol import ConstraintKind

_CACHE_SIZE = 64


class GrammarError(ValueError):
    """The constraint does not compile (maps to HTTP 400)."""


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - scripts/setup.sh installs it
        raise GrammarError(
            "structured output (regex/ebnf/json_schema) needs the xgrammar package; install it with "
            "scripts/setup.sh (pip install --no-deps xgrammar==0.2.8)"
        ) from exc
    return xgrammar


class GrammarCompiler:
    """Compiles constraints for one tokenizer, caching the most recent ``_CACHE_SIZE`` of them.

    Args:
        tokenizer: the served Hugging Face tokenizer.
        vocab_size: the model's vocabulary size (logit width; may exceed the tokenizer's).
        stop_token_ids: the ids that end a sequence (the model's EOS ids).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: Any = None
        self._cache: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            xgr = _xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        return self._compiler

    def compile(self, kind: ConstraintKind, spec: str) -> Any:
        """The compiled grammar of one constraint (``kind`` is the sampling parameter's name).

        Raises:
            GrammarError: the constraint is malformed; the message names the parameter.
        """
        key = (kind, spec)
        with self._lock:
            compiler = self._get_compiler()
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
            try:
                if kind == "regex":
                    compiled = compiler.compile_regex(spec)
                elif kind == "ebnf":
                    compiled = compiler.compile_grammar(spec)
                else:
                    compiled = compiler.compile_json_schema(spec, any_whitespace=True)
            except Exception as exc:  # xgrammar raises RuntimeError/ValueError with the parse error
                first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise GrammarError(f"sampling_params.{kind} does not compile: {first_line[:300]}") from exc
            self._cache[key] = compiled
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            return compiled


class Constraint:
    """One sequence's position in a compiled grammar: masks logits, follows sampled tokens."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        xgr = _xgrammar()
        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (``[vocab]`` float32) with every token the grammar forbids next set to ``-inf``."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        masked = logits.float().clone().unsqueeze(0)
        self._xgr.apply_token_bitmask_inplace(masked, self.bitmask)
        return masked[0]

    def accept(self, token: int) -> bool:
        """Advance past ``token``; ``False`` when the grammar does not allow it."""
        if self.matcher.is_terminated():
            return False
        return bool(self.matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        """Whether the grammar has accepted a stop token (the sequence is complete)."""
        return bool(self.matcher.is_terminated())
