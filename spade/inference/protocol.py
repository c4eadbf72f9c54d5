"""The subset of SGLang's HTTP API that SPADE uses, as typed wire models.

Field names are SGLang 0.5.x's own (``sglang/srt/managers/io_struct.py``: ``GenerateReqInput``,
``UpdateWeightFromDiskReqInput``/``Output``; ``sglang/srt/sampling/sampling_params.py``;
``sglang/srt/entrypoints/http_server.py`` for ``/model_info`` and the response of ``/generate``).
Both sides import these models: the client builds requests and reads responses with them, and the
embedded server validates requests and builds responses with them, so the two cannot drift apart;
``tests/unit/inference/test_contract.py`` pins the shapes against SGLang's.

Response shape of ``POST /generate`` (non-streaming, one prompt, ``n == 1``)::

    {"text": str, "output_ids": [int],
     "meta_info": {"id": str, "finish_reason": {"type": "stop", "matched": int | str}
                                              | {"type": "length", "length": int}
                                              | {"type": "abort", "message": str, ...},
                   "prompt_tokens": int, "completion_tokens": int, "cached_tokens": int,
                   "weight_version": str, "e2e_latency": float,
                   # only with return_logprob: one [logprob, token_id, text|None] per token
                   "output_token_logprobs": [[float, int, None]], "input_token_logprobs": [...]}}

With ``sampling_params.n > 1`` (SGLang's parallel sampling: ``GenerateReqInput._handle_parallel_sampling``
turns the request into a batch, ``TokenizerManager._handle_batch_request`` answers with
``asyncio.gather`` over the samples) the answer is a JSON **list** of ``n`` such objects, in sample
order, each with its own ``meta_info.id``. Every sample carries the request's own sampling
parameters, so with a ``sampling_seed`` all ``n`` samples are the same (SGLang seeds by
``(sampling_seed, position)``); ask for ``n`` distinct seeded samples with ``n`` requests.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: The SGLang release these shapes were read from.
SGLANG_VERSION = "0.5.23"

#: Most parallel samples one request may ask for (``sampling_params.n``).
MAX_PARALLEL_SAMPLES = 256

#: SGLang's structured-output parameters (``sampling_params.py``); at most one per request.
ConstraintKind = Literal["json_schema", "regex", "ebnf"]

#: The key of ``sampling_params.custom_params`` that asks the embedded server to compute one request
#: batch-invariantly (SPADE's per-request form of SGLang's ``--enable-deterministic-inference``).
BATCH_INVARIANT = "batch_invariant"


class SamplingParams(BaseModel):
    """SGLang's ``sampling_params`` (the subset SPADE uses; unknown keys are ignored like SGLang).

    ``temperature == 0`` means greedy decoding. ``top_k == -1`` (or any value ≥ the vocabulary)
    disables top-k, as in SGLang.
    """

    model_config = ConfigDict(extra="ignore")

    max_new_tokens: int = Field(default=128, ge=0, description="Most tokens to generate.")
    temperature: float = Field(default=1.0, ge=0.0, description="Softmax temperature; 0 is greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(default=-1, description="Keep the k most likely tokens; -1 keeps all.")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="Drop tokens below min_p × the top probability.")
    stop: str | list[str] | None = Field(default=None, description="Stop strings; the text is cut before them.")
    stop_token_ids: list[int] | None = Field(default=None, description="Token ids that end generation (kept).")
    ignore_eos: bool = Field(default=False, description="Keep generating past the model's EOS token.")
    skip_special_tokens: bool = Field(default=True, description="Drop special tokens from the returned text.")
    no_stop_trim: bool = Field(default=False, description="Keep the matched stop string in the text.")
    sampling_seed: int | None = Field(
        default=None,
        ge=-(2**63),
        le=2**63 - 1,
        description="Seed for this request's sampling: same seed, prompt and weights give the same tokens.",
    )
    n: int = Field(
        default=1,
        ge=1,
        le=MAX_PARALLEL_SAMPLES,
        description="Parallel samples of one prompt (one prefill); the answer is then a list of n results.",
    )
    regex: str | None = Field(default=None, description="Constrain the output to match this regular expression.")
    ebnf: str | None = Field(default=None, description="Constrain the output to this EBNF grammar (rule 'root').")
    json_schema: str | None = Field(default=None, description="Constrain the output to JSON valid for this schema.")
    custom_params: dict[str, Any] | None = Field(
        default=None,
        description="SGLang's free-form per-request parameters (for a custom logit processor; ignored otherwise). "
        "The embedded server reads one: batch_invariant (bool), compute this request's logits independently of "
        "what else is in flight (docs/inference.md, Batch-invariant mode).",
    )

    @field_validator("custom_params")
    @classmethod
    def _custom_params(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and BATCH_INVARIANT in value and not isinstance(value[BATCH_INVARIANT], bool):
            raise ValueError(f"custom_params.{BATCH_INVARIANT} must be true or false, got {value[BATCH_INVARIANT]!r}")
        return value

    @property
    def batch_invariant(self) -> bool:
        """Whether this request asks for the batch-invariant mode (``custom_params.batch_invariant``)."""
        return bool(self.custom_params and self.custom_params.get(BATCH_INVARIANT) is True)

    def with_batch_invariance(self) -> SamplingParams:
        """A copy that asks for the batch-invariant mode (other ``custom_params`` kept).

        >>> SamplingParams().with_batch_invariance().batch_invariant
        True
        """
        return self.model_copy(update={"custom_params": {**(self.custom_params or {}), BATCH_INVARIANT: True}})

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, got {value}")
        return value

    @model_validator(mode="after")
    def _one_constraint(self) -> SamplingParams:
        given = [name for name in ("json_schema", "regex", "ebnf") if getattr(self, name)]
        if len(given) > 1:
            raise ValueError(f"only one of json_schema, regex or ebnf can be set, got {', '.join(given)}")
        return self

    def constraint(self) -> tuple[ConstraintKind, str] | None:
        """The structured-output constraint as ``(kind, spec)``, or ``None`` (SGLang's precedence)."""
        for kind in ("json_schema", "regex", "ebnf"):
            spec = getattr(self, kind)
            if spec:
                return kind, spec
        return None

    def stop_strings(self) -> list[str]:
        """``stop`` as a list (SGLang accepts one string or a list)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class GenerateRequest(BaseModel):
    """``POST /generate`` body (SGLang ``GenerateReqInput``), one prompt given as token ids."""

    model_config = ConfigDict(extra="ignore")

    input_ids: list[int] | None = Field(
        default=None, description="The prompt, already tokenised (chat template applied)."
    )
    text: str | None = Field(default=None, description="The prompt as text (tokenised by the server); SPADE sends ids.")
    sampling_params: SamplingParams = SamplingParams()  # pydantic copies mutable defaults
    return_logprob: bool = Field(default=False, description="Return per-token logprobs in meta_info.")
    logprob_start_len: int = Field(
        default=-1, ge=-1, description="First prompt position to return input logprobs for; -1: none."
    )
    rid: str | None = Field(default=None, description="Request id, echoed as meta_info.id.")
    stream: bool = Field(default=False, description="Streaming is not used by SPADE on /generate; must be false.")

    @field_validator("input_ids")
    @classmethod
    def _input_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("input_ids must hold at least one token id")
        if any(t < 0 for t in value):
            raise ValueError("input_ids must be non-negative token ids")
        return value

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.input_ids is None) == (self.text is None):
            raise ValueError("give exactly one of input_ids (token ids) or text")
        return self


FinishType = Literal["stop", "length", "abort"]


class GenerateMetaInfo(BaseModel):
    """``meta_info`` of a ``/generate`` response."""

    model_config = ConfigDict(extra="allow")

    id: str
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    weight_version: str | None = None
    e2e_latency: float | None = None
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None
    input_token_logprobs: list[tuple[float | None, int, str | None]] | None = None


class GenerateResponse(BaseModel):
    """``/generate`` response for one prompt."""

    model_config = ConfigDict(extra="allow")

    text: str
    output_ids: list[int]
    meta_info: GenerateMetaInfo


class UpdateWeightsFromDiskRequest(BaseModel):
    """``POST /update_weights_from_disk`` body (SGLang ``UpdateWeightFromDiskReqInput``)."""

    model_config = ConfigDict(extra="ignore")

    model_path: str = Field(description="Checkpoint directory with the new weights.")
    load_format: str | None = Field(default=None, description="Accepted for compatibility; must be None or 'auto'.")
    abort_all_requests: bool = Field(default=False, description="Abort in-flight requests instead of draining them.")
    weight_version: str | None = Field(default=None, description="Version the server reports after the update.")
    flush_cache: bool = Field(default=True, description="Accepted for compatibility (no prefix cache here).")


class UpdateWeightsFromDiskResponse(BaseModel):
    """Response of ``/update_weights_from_disk`` (HTTP 200 on success, 400 on failure)."""

    success: bool
    message: str
    num_paused_requests: int = 0


class ServerInfo(BaseModel):
    """``GET /get_server_info`` (SGLang: its ``ServerArgs`` flattened, plus ``version``), the fields SPADE reads.

    ``batch_invariant_requests`` is SPADE's own: the embedded server honours
    ``sampling_params.custom_params.batch_invariant`` per request; SGLang has only the server-wide flag.
    """

    model_config = ConfigDict(extra="allow")

    model_path: str | None = None
    enable_deterministic_inference: bool = Field(
        default=False, description="Every request is computed batch-invariantly (SGLang's server flag)."
    )
    disable_radix_cache: bool = False
    version: str | None = None
    batch_invariant_requests: bool = Field(
        default=False, description="SPADE's embedded server: custom_params.batch_invariant is honoured per request."
    )


class ModelInfo(BaseModel):
    """``GET /model_info`` (the fields SGLang returns that mean something here)."""

    model_config = ConfigDict(extra="allow")

    model_path: str
    served_model_name: str | None = None
    tokenizer_path: str | None = None
    is_generation: bool = True
    preferred_sampling_params: dict[str, Any] | None = None
    weight_version: str | None = None
    model_type: str | None = None
    architectures: list[str] | None = None
