"""The lean decode step on tiny random Llama models: transformers' logits for every option it accepts."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.inference import rows as kernel_rows
from services.inference.kv import KVBatch
from services.inference.llama_decode import llama_decoder
from services.inference.quant import decode_step, prepare_weights

needs_kernel = pytest.mark.skipif(
    kernel_rows.fused_elementwise() is None, reason=f"no kernel here: {kernel_rows.unavailable_reason()}"
)

PROMPTS = [[1, 5, 9, 20, 33, 7], [2, 8, 4], [3, 3, 3, 3, 3, 3, 3, 3, 3, 40]]


def tiny_llama(**options: Any) -> LlamaForCausalLM:
    shape: dict[str, Any] = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    }
    config = LlamaConfig(**(shape | options))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)  # zero biases would hide a bias the lean step dropped
    return model


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"num_key_value_heads": 4},  # one query head per key/value head
        {"num_key_value_heads": 1},
        {"attention_bias": True, "mlp_bias": True},  # products with a bias are not stacked
        {"head_dim": 32},  # not hidden_size / heads
        {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 288},  # SDPA's GQA flag stops at 256
        {"tie_word_embeddings": True},
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ],
    ids=["gqa", "mha", "mqa", "biases", "head_dim", "wide heads", "tied", "llama3 rope"],
)
@pytest.mark.parametrize("rows", [[0], [0, 0], [0, 1, 2]], ids=["one row", "unpadded", "padded"])
@pytest.mark.parametrize(
    "fused",
    [
        False,
        pytest.param(True, marks=needs_kernel),
    ],
    ids=["torch's operators", "fused"],
)
def test_the_lean_step_gives_transformers_logits(options: dict[str, Any], rows: list[int], fused: bool) -> None:
    # fp32 weights take torch's operators (transformers' logits bit for bit); rounded weights take the kernel's
    # fused ones, the same arithmetic up to the order of the norms' sums and SiLU's exp: checked here on fp32.
    model = tiny_llama(**options)
    decoder = llama_decoder(model)
    assert decoder is not None and decoder.fused is None
    calls: list[str] = []
    if fused:

        class Counted:
            def __getattr__(self, name: str) -> Any:
                calls.append(name)
                return getattr(kernel_rows.kernel(), name)

        decoder.fused = Counted()  # type: ignore[assignment]
    prompts = [PROMPTS[i] for i in rows]
    with torch.inference_mode(), decode_step():
        hf_kv = KVBatch()
        hf_kv.add_rows([model(torch.tensor([ids[:-1]]), use_cache=True).cache for ids in prompts])
        lean_kv = copy.deepcopy(hf_kv)
        tokens, positions = [ids[-1] for ids in prompts], [len(ids) - 1 for ids in prompts]
        for _ in range(3):
            ids, pos = torch.tensor(tokens).unsqueeze(1), torch.tensor(positions).unsqueeze(1)
            hf = model(
                input_ids=ids, position_ids=pos, attention_mask=hf_kv.step_mask(), cache=hf_kv.cache, use_cache=True
            ).logits[:, -1]
            assert lean_kv.cache is not None
            lean = decoder(ids, pos, lean_kv.step_mask(), lean_kv.cache)
            assert (hf - lean).abs().max().item() < 1e-5
            tokens, positions = hf.argmax(-1).tolist(), [p + 1 for p in positions]
    layers = len(decoder.layers)
    assert calls.count("rms_norm") == (3 * (2 * layers + 1) if fused else 0)
    assert calls.count("rotate") == calls.count("silu_mul") == (3 * layers if fused else 0)


def test_only_models_it_computes_exactly_get_a_lean_step() -> None:
    assert llama_decoder(tiny_llama()) is not None
    hooked = tiny_llama()
    hooked.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    assert llama_decoder(hooked) is None, "a hook on a layer would be skipped by the lean step"
    eager = tiny_llama()
    eager.config._attn_implementation = "eager"
    assert llama_decoder(eager) is None
    assert llama_decoder(torch.nn.Linear(2, 2)) is None


@needs_kernel
def test_steps_of_rounded_weights_take_the_fused_operations(monkeypatch: pytest.MonkeyPatch) -> None:
    model = prepare_weights(tiny_llama(), "int8")
    decoder = llama_decoder(model)
    assert decoder is not None and decoder.fused is kernel_rows.kernel()
    monkeypatch.setenv("SPADE_ROWS_FUSED", "0")
    off = llama_decoder(prepare_weights(tiny_llama(), "int8"))
    assert off is not None and off.fused is None
