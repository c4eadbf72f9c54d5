"""The wire contract with SGLang 0.5.23, pinned.

Field names below were read from SGLang 0.5.23's own source (``pip download sglang==0.5.23
--no-deps``): ``sglang/srt/managers/io_struct.py`` (``GenerateReqInput``,
``UpdateWeightFromDiskReqInput``/``ReqOutput``), ``sglang/srt/sampling/sampling_params.py``
(``SamplingParams``) and ``sglang/srt/managers/tokenizer_manager.py`` (the ``meta_info`` of a
``/generate`` answer). If one of our models grows a field SGLang does not have, or the recorded
SGLang answer stops parsing, this test fails.
"""

from __future__ import annotations

from typing import Any

import pytest

from spade.inference.client import FinishReason, Generation, InferenceError
from spade.inference.protocol import (
    SGLANG_VERSION,
    GenerateRequest,
    GenerateResponse,
    ModelInfo,
    SamplingParams,
    ServerInfo,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDiskResponse,
)

# sglang 0.5.23, io_struct.GenerateReqInput (the fields we might send).
SGLANG_GENERATE_REQ_FIELDS = {
    "rid", "session_id", "text", "input_ids", "input_embeds", "image_data", "sampling_params",
    "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
    "return_text_in_logprobs", "stream", "log_metrics", "return_hidden_states", "lora_path",
}  # fmt: skip
# sglang 0.5.23, sampling_params.SamplingParams API fields.
SGLANG_SAMPLING_FIELDS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "logit_bias", "sampling_seed", "custom_params",
}  # fmt: skip
# sglang 0.5.23, io_struct.UpdateWeightFromDiskReqInput / ReqOutput.
SGLANG_UPDATE_REQ_FIELDS = {
    "model_path", "load_format", "abort_all_requests", "weight_version", "is_async", "torch_empty_cache",
    "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache",
}  # fmt: skip
SGLANG_UPDATE_RESP_FIELDS = {"success", "message", "num_paused_requests"}
# sglang 0.5.23, http_server.model_info().
SGLANG_MODEL_INFO_FIELDS = {
    "model_path", "served_model_name", "tokenizer_path", "is_generation", "preferred_sampling_params",
    "weight_version", "load_format", "reasoning_parser", "tool_call_parser", "disaggregation_mode",
    "has_image_understanding", "has_audio_understanding", "model_type", "architectures",
}  # fmt: skip
# sglang 0.5.23, http_server.get_server_info(): ServerArgs fields (server_args.py) + "version".
SGLANG_SERVER_INFO_FIELDS = {"model_path", "enable_deterministic_inference", "disable_radix_cache", "version"}
# SPADE's own additions to /get_server_info, documented in docs/inference.md (SGLang has no such field).
SPADE_SERVER_INFO_FIELDS = {"batch_invariant_requests"}

# A /generate answer in SGLang 0.5.23's shape (tokenizer_manager: meta_info + convert_logprob_style;
# schedule_batch.FINISH_MATCHED_TOKEN.to_json), return_logprob=True, skip_tokenizer_init=False.
SGLANG_GENERATE_ANSWER: dict[str, Any] = {
    "text": "Paris.",
    "output_ids": [42, 13, 2],
    "meta_info": {
        "id": "b1f0c2",
        "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": 17,
        "weight_version": "3",
        "num_retractions": 0,
        "input_token_logprobs": [],
        "output_token_logprobs": [[-0.25, 42, None], [-0.5, 13, None], [-0.01, 2, None]],
        "output_token_logprobs_length": 3,
        "reasoning_tokens": 0,
        "completion_tokens": 3,
        "cached_tokens": 0,
        "e2e_latency": 0.12,
    },
}


def test_version_is_recorded() -> None:
    assert SGLANG_VERSION == "0.5.23"


@pytest.mark.parametrize(
    ("model", "sglang_fields"),
    [
        (GenerateRequest, SGLANG_GENERATE_REQ_FIELDS),
        (SamplingParams, SGLANG_SAMPLING_FIELDS),
        (UpdateWeightsFromDiskRequest, SGLANG_UPDATE_REQ_FIELDS),
        (UpdateWeightsFromDiskResponse, SGLANG_UPDATE_RESP_FIELDS),
        (ModelInfo, SGLANG_MODEL_INFO_FIELDS),
        (ServerInfo, SGLANG_SERVER_INFO_FIELDS | SPADE_SERVER_INFO_FIELDS),
    ],
)
def test_every_field_we_use_exists_in_sglang(model: type, sglang_fields: set[str]) -> None:
    ours = set(model.model_fields)  # type: ignore[attr-defined]
    assert ours <= sglang_fields, f"not SGLang fields: {sorted(ours - sglang_fields)}"


def test_the_request_body_we_send_uses_sglang_names() -> None:
    request = GenerateRequest(
        input_ids=[1, 2, 3],
        sampling_params=SamplingParams(max_new_tokens=8, temperature=0.6, top_p=0.9, top_k=20, stop=["\n\n"]),
        return_logprob=True,
    )
    body = request.model_dump(mode="json", exclude_none=True)
    assert set(body) <= SGLANG_GENERATE_REQ_FIELDS
    assert set(body["sampling_params"]) <= SGLANG_SAMPLING_FIELDS
    assert body["input_ids"] == [1, 2, 3] and body["return_logprob"] is True
    assert body["sampling_params"]["max_new_tokens"] == 8 and body["sampling_params"]["stop"] == ["\n\n"]


def test_an_sglang_answer_parses_into_a_generation() -> None:
    gen = Generation.from_response(GenerateResponse.model_validate(SGLANG_GENERATE_ANSWER), server="http://w0")
    assert gen.output_ids == [42, 13, 2]
    assert gen.logprobs == [-0.25, -0.5, -0.01]
    assert gen.finish_reason is FinishReason.STOP and gen.matched_stop == 2
    assert gen.weight_version == "3" and gen.prompt_tokens == 17 and gen.text == "Paris."


def test_length_and_abort_finish_reasons() -> None:
    answer = {**SGLANG_GENERATE_ANSWER, "meta_info": {**SGLANG_GENERATE_ANSWER["meta_info"]}}
    answer["meta_info"]["finish_reason"] = {"type": "length", "length": 3}
    assert Generation.from_response(GenerateResponse.model_validate(answer)).finish_reason is FinishReason.LENGTH
    answer["meta_info"]["finish_reason"] = {"type": "abort", "message": "x", "status_code": 503, "err_type": None}
    assert Generation.from_response(GenerateResponse.model_validate(answer)).finish_reason is FinishReason.ABORT


def test_logprobs_that_disagree_with_output_ids_are_rejected() -> None:
    answer = {**SGLANG_GENERATE_ANSWER, "output_ids": [42, 13, 3]}
    with pytest.raises(InferenceError, match="do not match"):
        Generation.from_response(GenerateResponse.model_validate(answer))


@pytest.mark.parametrize(
    "bad",
    [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": 0}, {"top_k": -5}, {"max_new_tokens": -1}],
)
def test_invalid_sampling_params_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_stop_accepts_a_string_or_a_list() -> None:
    assert SamplingParams(stop="END").stop_strings() == ["END"]
    assert SamplingParams(stop=["a", "", "b"]).stop_strings() == ["a", "b"]
    assert SamplingParams().stop_strings() == []
