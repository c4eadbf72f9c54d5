"""Stand-ins for the warm start's unit tests: a word tokenizer with a chat template, reports, documents.

The unit tests check the pairs' construction (parsing back, truthful skills, the guard against
invalid answers) and the SFT's loss mask; neither needs the real tokenizer nor the sandbox, which
the integration tests (``tests/integration/warmstart/``) use.
"""

from __future__ import annotations

import zlib

from services.designer.corpus.loader import Document
from spade.envs import CHECK_NAMES, CheckResult, ValidationReport

EOS = 2


class WordTokenizer:
    """One id per whitespace-separated word (stable across processes), EOS id 2."""

    eos_token_id = EOS

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [10 + zlib.crc32(w.encode()) % 5000 for w in text.split()]


def chat(messages: list[dict[str, str]]) -> list[int]:
    """A chat template: each message's words after a role id, then the assistant header id."""
    tokenizer = WordTokenizer()
    ids: list[int] = []
    for message in messages:
        ids += [3, *tokenizer.encode(message["content"])]
    return [*ids, 4]


def report(valid: bool, code: str = "", failed: str = "seed_variety") -> ValidationReport:
    checks = [CheckResult(name, valid or name != failed, "" if valid else "made to fail") for name in CHECK_NAMES]
    return ValidationReport(valid=valid, setting="game", env_class="XEnv", checks=checks, repaired_code=code)


def documents(count: int) -> list[Document]:
    return [Document(text=" ".join(f"word{i}-{j}" for j in range(150)), metadata={"line": i + 1}) for i in range(count)]
