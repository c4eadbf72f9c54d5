"""Fixtures of the agent tests: the real policy tokenizer (SmolLM2, converted once, offline)."""

from __future__ import annotations

import pytest

from services.rollout.policy import FormatterTemplate
from spade.inference.chat import ChatFormatter
from tests.conftest import needs


@pytest.fixture(scope="session")
@needs("model")
def formatter() -> ChatFormatter:
    from spade.inference.models import ensure_default_model

    return ChatFormatter.from_pretrained(ensure_default_model())


@pytest.fixture(scope="session")
def template(formatter: ChatFormatter) -> FormatterTemplate:
    return FormatterTemplate(formatter)
