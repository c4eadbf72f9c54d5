"""The lean Llama decode step computes transformers' decode step: the same logits and the same KV."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers.cache_utils import DynamicCache

from services.inference.engine import BatchEngine, GenerationJob
from services.inference.kv import KVBatch, layer_kv
from services.inference.llama_decode import LlamaDecoder, llama_decoder
from services.inference.quant import decode_step, prepare_weights
from services.inference.settings import WeightsMode
from spade.inference.models import load_model
from spade.inference.protocol import SamplingParams
from tests.integration.inference.conftest import chat_ids, teacher_forced_logprobs

pytestmark = pytest.mark.slow

PROMPTS = [
    [1, 504, 3458, 282, 253, 1345, 30, 2],
    [1, 6049, 7352, 28, 2, 3, 314],
    [1, 45, 99, 1200, 7, 88, 913, 2048, 11, 502, 77, 5, 31, 64],
]


def _batch(model: torch.nn.Module, prompts: list[list[int]]) -> tuple[KVBatch, list[int], list[int]]:
    """The engine's KV layout for ``prompts`` (right-aligned, left-padded), each row's next token and position."""
    caches = []
    for ids in prompts:
        cache = DynamicCache()
        model(torch.tensor([ids[:-1]]), cache=cache, use_cache=True)
        caches.append(cache)
    kv = KVBatch()
    kv.add_rows(caches)
    return kv, [ids[-1] for ids in prompts], [len(ids) - 1 for ids in prompts]


def _hf_step(model: torch.nn.Module, kv: KVBatch, tokens: list[int], positions: list[int]) -> torch.Tensor:
    out = model(
        input_ids=torch.tensor(tokens).unsqueeze(1),
        position_ids=torch.tensor(positions).unsqueeze(1),
        attention_mask=kv.step_mask(),
        cache=kv.cache,
        use_cache=True,
    )
    return out.logits[:, -1, :].float()


def _lean_step(decoder: LlamaDecoder, kv: KVBatch, tokens: list[int], positions: list[int]) -> torch.Tensor:
    assert kv.cache is not None
    mask = kv.step_mask()
    return decoder(torch.tensor(tokens).unsqueeze(1), torch.tensor(positions).unsqueeze(1), mask, kv.cache).float()


@pytest.mark.parametrize(
    ("weights", "tolerance"),
    # On the AMD EPYC VM both gave transformers' logits bit for bit (the stacked q/k/v and gate/up
    # products sum each output in the same order); the bounds leave room for another CPU's kernels.
    [("float32", 1e-5), ("bf16", 5e-3), ("int8", 5e-3), ("int4", 5e-3)],
)
@pytest.mark.parametrize("rows", [[0], [0, 0], [0, 1, 2]], ids=["one row", "rows without padding", "padded rows"])
def test_lean_steps_give_transformers_logits_and_kv(
    model_dir: Path, weights: WeightsMode, tolerance: float, rows: list[int]
) -> None:
    model = prepare_weights(load_model(model_dir), weights)
    decoder = llama_decoder(model)
    assert decoder is not None, "the default model (a LlamaForCausalLM) has no lean decode step"
    prompts = [PROMPTS[i] for i in rows]
    with torch.inference_mode(), decode_step():
        kv_hf, tokens, positions = _batch(model, prompts)
        kv_lean = copy.deepcopy(kv_hf)
        for _ in range(4):  # several steps: each appends to the cache the next one reads
            hf = _hf_step(model, kv_hf, tokens, positions)
            lean = _lean_step(decoder, kv_lean, tokens, positions)
            logprobs_hf, logprobs_lean = torch.log_softmax(hf, -1), torch.log_softmax(lean, -1)
            assert (logprobs_hf - logprobs_lean).abs().max().item() < tolerance
            tokens = hf.argmax(-1).tolist()
            positions = [p + 1 for p in positions]
    assert kv_hf.cache is not None and kv_lean.cache is not None
    for hf_layer, lean_layer in zip(kv_hf.cache.layers, kv_lean.cache.layers, strict=True):
        for a, b in zip(layer_kv(hf_layer), layer_kv(lean_layer), strict=True):
            assert a.shape == b.shape
            assert (a - b).abs().max().item() < tolerance


def test_the_engine_decodes_its_served_model_with_the_lean_step(engine: BatchEngine) -> None:
    # The engine's exactness tests (teacher forcing, weight updates) then hold for the lean step: a
    # decoder left on old weights after an update would fail test_weight_update's logprob bounds.
    assert engine.decoder is not None
    assert engine.decoder.lm_head is engine.model.lm_head
    assert engine.decoder.layers[0].o_proj is engine.model.model.layers[0].self_attn.o_proj


async def test_an_engine_without_the_lean_step_decodes_through_transformers_alike(
    engine: BatchEngine, model_dir: Path
) -> None:
    plain = BatchEngine(model_dir, torch_threads=1, lean_decode=False)
    plain.start()
    try:
        assert plain.decoder is None
        prompt = chat_ids(engine, "Name three rivers.")
        job = GenerationJob(prompt, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
        hf, lean = await plain.generate(job), await engine.generate(job)
    finally:
        plain.close()
    assert hf.output_ids == lean.output_ids
    reference = teacher_forced_logprobs(plain.model, prompt, hf.output_ids, 0.0)
    assert max(abs(a - b) for a, b in zip(hf.output_logprobs, reference, strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(hf.output_logprobs, lean.output_logprobs, strict=True)) < 1e-4
