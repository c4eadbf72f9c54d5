"""regex / ebnf / json_schema on the real model: every output obeys its grammar, logprobs are the
constrained distribution's (as SGLang reports them), and bad grammars are a 400."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import torch

from services.designer.core.parsing import ParsedOutput, parse_output
from services.inference.engine import BatchEngine
from services.inference.grammar import Constraint
from spade.inference.answer_format import DESIGNER_ANSWER_EBNF, DESIGNER_ANSWER_REGEX
from tests.integration.inference.conftest import chat_ids

pytestmark = pytest.mark.slow

# A narrow instance of the designer's answer format (short enough for a few dozen tokens), so the
# model completes it; it is a subset of DESIGNER_ANSWER_REGEX's language.
SHORT_ANSWER = r"```python\nclass [A-Z][a-z]{1,8}Env:\n    max_turns = [1-9]\n```\n### HINT\n[A-Z][a-z ,]{3,30}\."


def _constrained_logprobs(
    engine: BatchEngine, regex: str, prompt: list[int], output: list[int], t: float
) -> list[float]:
    """Teacher-forced logprobs with the grammar mask applied step by step (SGLang's convention)."""
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + output])).logits[0].float()
    constraint = Constraint(engine.grammars.compile("regex", regex), engine.vocab_size)
    out = []
    for j, token in enumerate(output):
        masked = constraint.mask(logits[len(prompt) - 1 + j])
        out.append(float(torch.log_softmax(masked / t, dim=-1)[token]))
        constraint.accept(token)
    return out


async def test_regex_constrained_answers_always_match_and_parse(http: httpx.AsyncClient, engine: BatchEngine) -> None:
    prompt = chat_ids(engine, "Write a game environment class and a hint.")
    params = {"regex": SHORT_ANSWER, "max_new_tokens": 48, "temperature": 1.0, "n": 3, "sampling_seed": None}
    torch.manual_seed(3)
    body = {
        "input_ids": prompt,
        "sampling_params": {k: v for k, v in params.items() if v is not None},
        "return_logprob": True,
    }
    response = await http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    for sample in response.json():
        text = sample["text"]
        assert sample["meta_info"]["finish_reason"]["type"] == "stop", text
        assert re.fullmatch(SHORT_ANSWER, text) and re.fullmatch(DESIGNER_ANSWER_REGEX, text), text
        assert isinstance(parse_output(text), ParsedOutput), text
        served = [lp for lp, _, _ in sample["meta_info"]["output_token_logprobs"]]
        reference = _constrained_logprobs(engine, SHORT_ANSWER, prompt, sample["output_ids"], 1.0)
        assert max(abs(a - b) for a, b in zip(served, reference, strict=True)) < 1e-4


async def test_the_designer_formats_constrain_from_the_first_token(
    engine: BatchEngine, http: httpx.AsyncClient
) -> None:
    """The full designer regex and EBNF: the answer starts with the fence, whatever the model prefers."""
    prompt = chat_ids(engine, "Say hello.")
    for kind, spec in (("regex", DESIGNER_ANSWER_REGEX), ("ebnf", DESIGNER_ANSWER_EBNF)):
        body = {"input_ids": prompt, "sampling_params": {kind: spec, "max_new_tokens": 8, "temperature": 0}}
        answer = (await http.post("/generate", json=body)).json()
        assert answer["text"].startswith("```python\n"[: len(answer["text"])]) and len(answer["text"]) > 3, answer


async def test_ebnf_and_json_schema(http: httpx.AsyncClient, engine: BatchEngine) -> None:
    prompt = chat_ids(engine, "Is the sky blue? Answer in JSON.")
    ebnf = 'root ::= "The answer is " ("yes" | "no") "."'
    body = {"input_ids": prompt, "sampling_params": {"ebnf": ebnf, "max_new_tokens": 12, "temperature": 0}}
    text = (await http.post("/generate", json=body)).json()["text"]
    assert text in ("The answer is yes.", "The answer is no.")
    schema = {
        "type": "object",
        "properties": {"blue": {"type": "boolean"}},
        "required": ["blue"],
        "additionalProperties": False,
    }
    chat = {
        "messages": [{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
        "max_tokens": 24,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    }
    reply = (await http.post("/v1/chat/completions", json=chat)).json()
    assert reply["choices"][0]["finish_reason"] == "stop", reply
    assert isinstance(json.loads(reply["choices"][0]["message"]["content"])["blue"], bool)


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"regex": "(unclosed"}, "sampling_params.regex"),
        ({"ebnf": "root ::= missing_rule"}, "sampling_params.ebnf"),
        ({"json_schema": "{not json"}, "sampling_params.json_schema"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "only one of"),
    ],
)
async def test_bad_constraints_are_a_400(http: httpx.AsyncClient, params: dict, needle: str) -> None:
    response = await http.post("/generate", json={"input_ids": [1, 2], "sampling_params": params})
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]
