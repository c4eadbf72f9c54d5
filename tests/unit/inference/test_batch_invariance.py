"""The batch-invariant mode's wire form and chunk arithmetic (the engine's behaviour is tested with the
real model in tests/integration/inference/test_batch_invariance.py)."""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import ValidationError

from services.inference.invariance import whole_chunks
from spade.inference.client import InferenceClient
from spade.inference.protocol import GenerateRequest, SamplingParams, ServerInfo


def test_the_mode_is_asked_for_in_sglangs_custom_params() -> None:
    plain = SamplingParams(custom_params={"other": 1})
    assert not plain.batch_invariant and not SamplingParams().batch_invariant
    asked = plain.with_batch_invariance()
    assert asked.batch_invariant and asked.custom_params == {"other": 1, "batch_invariant": True}
    body = GenerateRequest(input_ids=[1], sampling_params=asked).model_dump(mode="json", exclude_none=True)
    assert body["sampling_params"]["custom_params"] == {"other": 1, "batch_invariant": True}
    assert (
        "custom_params"
        not in GenerateRequest(input_ids=[1]).model_dump(mode="json", exclude_none=True)["sampling_params"]
    )


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_a_batch_invariant_that_is_not_a_bool_is_refused(bad: object) -> None:
    with pytest.raises(ValidationError, match=r"custom_params\.batch_invariant must be true or false"):
        SamplingParams(custom_params={"batch_invariant": bad})


def test_an_sglang_server_info_parses() -> None:
    # A cut of SGLang 0.5's /get_server_info: ServerArgs flattened, scheduler info, version.
    answer = {
        "model_path": "Qwen/Qwen3-8B",
        "tokenizer_path": "Qwen/Qwen3-8B",
        "attention_backend": "fa3",
        "enable_deterministic_inference": True,
        "disable_radix_cache": False,
        "max_total_num_tokens": 812_345,
        "internal_states": [{"avg_spec_accept_length": None}],
        "version": "0.5.23",
    }
    info = ServerInfo.model_validate(answer)
    assert info.enable_deterministic_inference and not info.batch_invariant_requests
    assert not ServerInfo.model_validate({"model_path": "m", "version": "0.4.0"}).enable_deterministic_inference


@pytest.mark.parametrize(("tokens", "whole"), [(0, 0), (127, 0), (128, 128), (300, 256), (384, 384)])
def test_whole_chunks(tokens: int, whole: int) -> None:
    assert whole_chunks(tokens, 128) == whole


def _answer(request: httpx.Request) -> httpx.Response:
    ids = [5]
    meta = {"id": "r", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 1, "completion_tokens": 1}
    return httpx.Response(200, json={"text": "x", "output_ids": ids, "meta_info": meta})


async def test_the_batch_invariant_view_asks_for_the_mode_on_every_request_and_shares_the_workers() -> None:
    seen: list[dict] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content)["sampling_params"])
        return _answer(request)

    transport = httpx.MockTransport(handler)
    async with InferenceClient(["http://w0"], transports={"http://w0": transport}) as client:
        view = client.batch_invariant()
        await client.generate([1], SamplingParams(max_new_tokens=1), return_logprob=False)
        await view.generate([1], SamplingParams(max_new_tokens=1, custom_params={"k": "v"}), return_logprob=False)
        await view.generate_n([1], SamplingParams(max_new_tokens=1), n=1, return_logprob=False)
        client.set_urls(["http://w0", "http://w1"])
        assert view.urls == client.urls == ["http://w0", "http://w1"]
    assert "custom_params" not in seen[0]
    assert seen[1]["custom_params"] == {"k": "v", "batch_invariant": True}
    assert seen[2]["custom_params"] == {"batch_invariant": True}


async def test_server_info_is_none_where_the_server_has_no_such_route() -> None:
    async def sglang(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/get_server_info"
        return httpx.Response(200, json={"enable_deterministic_inference": True, "version": "0.5.23"})

    async def other(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"detail": "Not Found"})

    transports = {"http://w0": httpx.MockTransport(sglang), "http://w1": httpx.MockTransport(other)}
    async with InferenceClient(["http://w0", "http://w1"], transports=transports) as client:
        first, second = await client.server_info()
    assert first is not None and first.enable_deterministic_inference and second is None


def test_the_server_flag_reaches_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from services.inference import wiring
    from services.inference.settings import InferenceSettings
    from spade.cli import main

    built: dict[str, object] = {}

    async def serve_forever(settings: InferenceSettings, stop: object) -> None:
        built["settings"] = settings

    monkeypatch.setattr(wiring, "serve_forever", serve_forever)
    monkeypatch.setattr(wiring, "BatchEngine", lambda *args, **kwargs: kwargs)
    result = CliRunner().invoke(main, ["serve", "inference", "--enable-deterministic-inference"])
    assert result.exit_code == 0, result.output
    settings = built["settings"]
    assert isinstance(settings, InferenceSettings) and settings.enable_deterministic_inference
    assert wiring.build_engine(settings)["batch_invariant"] is True  # type: ignore[index]
    assert wiring.build_engine(InferenceSettings())["batch_invariant"] is False  # type: ignore[index]
