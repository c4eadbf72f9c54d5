"""The new generation parameters, without a model: n, constraints, seeds, streaming text, the
designer's answer format, and the client's n-sample calls (against SGLang's answer shapes)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from services.designer.core.parsing import HINT_MARKER as PARSER_HINT_MARKER
from services.designer.core.parsing import ParsedOutput, ParseFailure, parse_output
from services.inference.chat_completions import ChatCompletionRequest
from services.inference.engine import InvalidRequest
from services.inference.streaming import IncrementalText
from spade.envs.examples import EXAMPLES
from spade.inference.answer_format import (
    DESIGNER_ANSWER_REGEX,
    HINT_MARKER,
    designer_answer,
)
from spade.inference.client import InferenceClient
from spade.inference.protocol import MAX_PARALLEL_SAMPLES, SamplingParams
from spade.inference.seeds import SEED_LIMIT, derive_sampling_seed
from spade.retry import RetryPolicy

# -- sampling parameters -------------------------------------------------------------------------


def test_at_most_one_constraint_and_n_is_bounded() -> None:
    assert SamplingParams(regex="a+").constraint() == ("regex", "a+")
    assert SamplingParams(ebnf='root ::= "a"').constraint() == ("ebnf", 'root ::= "a"')
    assert SamplingParams().constraint() is None
    with pytest.raises(ValueError, match="only one of json_schema, regex or ebnf"):
        SamplingParams(regex="a", ebnf='root ::= "a"')
    for bad in (0, MAX_PARALLEL_SAMPLES + 1):
        with pytest.raises(ValueError):
            SamplingParams(n=bad)
    with pytest.raises(ValueError):
        SamplingParams(sampling_seed=2**63)


def test_chat_request_maps_openai_fields_to_sampling_params() -> None:
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}],
        n=3,
        seed=5,
        max_tokens=7,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "integer"}}},
    )
    params = body.sampling()
    assert (params.n, params.sampling_seed, params.max_new_tokens) == (3, 5, 7)
    assert json.loads(params.json_schema or "") == {"type": "integer"}
    as_object = ChatCompletionRequest(messages=[{"role": "user"}], response_format={"type": "json_object"})
    assert json.loads(as_object.sampling().json_schema or "") == {"type": "object"}
    with pytest.raises(InvalidRequest, match=r"response_format\.type"):
        ChatCompletionRequest(messages=[{"role": "user"}], response_format={"type": "xml"}).sampling()


# -- seeds ---------------------------------------------------------------------------------------


def test_seeds_are_stable_distinct_per_coordinate_and_in_range() -> None:
    base = ("run", "env", 3, 42, "hint", 0)
    seed = derive_sampling_seed(*base)
    assert seed == derive_sampling_seed(*base) and 0 <= seed < SEED_LIMIT
    variants = [
        ("run2", "env", 3, 42, "hint", 0),
        ("run", "env2", 3, 42, "hint", 0),
        ("run", "env", 4, 42, "hint", 0),
        ("run", "env", 3, 43, "hint", 0),
        ("run", "env", 3, 42, "no_hint", 0),
        ("run", "env", 3, 42, "hint", 1),
    ]
    seeds = {derive_sampling_seed(*v) for v in variants} | {seed}
    assert len(seeds) == len(variants) + 1
    # Field boundaries are encoded: ("a", "bc") and ("ab", "c") differ.
    assert derive_sampling_seed("a", "bc", 0, 0, "x", 0) != derive_sampling_seed("ab", "c", 0, 0, "x", 0)
    with pytest.raises(ValueError, match="turn"):
        derive_sampling_seed("r", "e", 0, 0, "hint", -1)


# -- streamed text -------------------------------------------------------------------------------

PIECES = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "\xe2", 6: "\x82\xac", 7: "<END>", 8: "!"}


def _decode(ids: list[int]) -> str:
    """Bytes-level pieces: 5 then 6 make a euro sign, 5 alone is an incomplete character."""
    raw = "".join(PIECES[i] for i in ids).encode("latin-1")
    return raw.decode("utf-8", errors="replace")


def _stream(ids: list[int], final: str, stops: tuple[str, ...] = ()) -> list[str]:
    text = IncrementalText(_decode, stops)
    return [*(text.push(i) for i in ids), text.finish(final)]


def test_deltas_reassemble_to_the_final_text_and_wait_for_whole_characters() -> None:
    deltas = _stream([1, 2, 5, 6, 3], "Hello\u20ac wor")
    assert "".join(deltas) == "Hello\u20ac wor"
    assert "\ufffd" not in "".join(deltas[:3]), "half a character was sent"


def test_text_that_may_start_a_stop_string_is_held_back() -> None:
    ids, stops = [1, 2, 7], ("<END>",)
    deltas = _stream(ids, "Hello", stops)  # the server cuts the text before the stop string
    assert "".join(deltas) == "Hello"
    assert not any("<" in d for d in deltas)


# -- the designer's answer format ----------------------------------------------------------------


def test_the_marker_is_the_parsers() -> None:
    assert HINT_MARKER == PARSER_HINT_MARKER


def test_every_example_env_as_an_answer_matches_the_format_and_parses() -> None:
    """The contract's example envs with their own hints: what a designer should write."""
    assert len(EXAMPLES) >= 5
    for example in EXAMPLES.values():
        answer = designer_answer(example.code, example.hint)
        assert re.fullmatch(DESIGNER_ANSWER_REGEX, answer), example.name
        parsed = parse_output(answer)
        assert isinstance(parsed, ParsedOutput), (example.name, parsed)
        assert parsed.hint == example.hint.strip()[: len(parsed.hint)]


@pytest.mark.parametrize(
    "answer",
    [
        "Sure! ```python\nclass AEnv:\n    pass\n```\n### HINT\nx",  # prose before the fence
        "```python\nx = 1\n```\n### HINT\nx",  # no class
        "```python\nclass AEnv:\n    pass\n```\n### HINT\n   \nx",  # blank first hint line
        "```python\nclass AEnv:\n    s = '```'\n```\n### HINT\nx",  # a fence inside the code
        "```python\nclass AEnv:\n    pass\n```\nHINT: x",  # another marker spelling
    ],
)
def test_the_format_refuses_what_could_fail_to_parse(answer: str) -> None:
    assert re.fullmatch(DESIGNER_ANSWER_REGEX, answer) is None


def test_whatever_the_format_allows_parses() -> None:
    """Awkward but allowed answers: hint-like lines in the code, a multi-line hint, indented class."""
    answers = [
        "```python\n# HINT: not here\n    class AEnv(Base):\n        x = 1\n```\n### HINT\n a\n\nb",
        "```python\nimport random\n\nclass AEnv:\n    '''### HINT in a docstring'''\n```\n### HINT\nGo.",
    ]
    for answer in answers:
        assert re.fullmatch(DESIGNER_ANSWER_REGEX, answer)
        assert not isinstance(parse_output(answer), ParseFailure), answer


# -- the client's n-sample calls -----------------------------------------------------------------


def _sample(i: int, seed: int | None) -> dict:
    ids = [100 + i, 2]
    return {
        "text": f"s{i}",
        "output_ids": ids,
        "meta_info": {
            "id": f"r-{i}-{seed}",
            "finish_reason": {"type": "stop", "matched": 2},
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "weight_version": "4",
            "output_token_logprobs": [[-0.5, t, None] for t in ids],
        },
    }


async def test_generate_n_sends_n_and_reads_sglangs_list_answer() -> None:
    bodies: list[dict] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        n = body["sampling_params"].get("n", 1)
        answer = [_sample(i, None) for i in range(n)]
        return httpx.Response(200, json=answer if n > 1 else answer[0])

    transport = httpx.MockTransport(handler)
    retry = RetryPolicy(attempts=1, initial_s=0.001, max_s=0.001, jitter_s=0.0)
    async with InferenceClient(["http://w"], transports={"http://w": transport}, retry=retry) as client:
        samples = await client.generate_n([1, 2, 3], SamplingParams(temperature=0.7), n=3)
        assert [g.output_ids for g in samples] == [[100, 2], [101, 2], [102, 2]]
        assert all(g.weight_version == "4" and g.logprobs == [-0.5, -0.5] for g in samples)
        assert bodies[-1]["sampling_params"]["n"] == 3
        one = await client.generate_n([1, 2, 3], None, n=1)
        assert len(one) == 1
        with pytest.raises(ValueError, match="generate_n"):
            await client.generate([1], SamplingParams(n=2))


async def test_generate_seeded_sends_one_request_per_seed() -> None:
    seeds_seen: list[int] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        params = json.loads(request.content)["sampling_params"]
        seeds_seen.append(params["sampling_seed"])
        return httpx.Response(200, json=_sample(params["sampling_seed"], params["sampling_seed"]))

    transport = httpx.MockTransport(handler)
    retry = RetryPolicy(attempts=1, initial_s=0.001, max_s=0.001, jitter_s=0.0)
    async with InferenceClient(["http://w"], transports={"http://w": transport}, retry=retry) as client:
        samples = await client.generate_seeded([1, 2], SamplingParams(temperature=1.0), seeds=[7, 8, 9])
    assert sorted(seeds_seen) == [7, 8, 9]
    assert [g.output_ids[0] for g in samples] == [107, 108, 109], "results come back in seed order"
