"""The inference client: SGLang's HTTP API, shared by the designer and the rollout.

The same client talks to SGLang on GPU nodes and to the embedded CPU server
(``services.inference``), which implements the subset of the API used here.
"""

from spade.inference.chat import ChatFormatError, ChatFormatter
from spade.inference.client import (
    ChatGeneration,
    FinishReason,
    Generation,
    InferenceClient,
    InferenceError,
    InferenceRequestError,
    InferenceUnavailable,
    WeightUpdateResult,
)
from spade.inference.protocol import SGLANG_VERSION, SamplingParams
from spade.inference.seeds import derive_sampling_seed

__all__ = [
    "SGLANG_VERSION",
    "ChatFormatError",
    "ChatFormatter",
    "ChatGeneration",
    "FinishReason",
    "Generation",
    "InferenceClient",
    "InferenceError",
    "InferenceRequestError",
    "InferenceUnavailable",
    "SamplingParams",
    "WeightUpdateResult",
    "derive_sampling_seed",
]
