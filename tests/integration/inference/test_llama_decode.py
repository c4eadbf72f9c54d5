"""The lean Llama decode step computes transformers' decode step: the same logits and the same KV."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.cache_utils import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from services.inference import rows as rows_kernel
from services.inference.engine import BatchEngine, GenerationJob
from services.inference.kv import KVBatch, layer_kv
from services.inference.llama_decode import LlamaDecoder, llama_decoder
from services.inference.prefill import cache_of
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
#: Past rows.BF16_LONG_POSITIONS, where steps of more rows take the engine's kernel beside oneDNN.
LONG_PROMPTS = [
    [1, *torch.randint(3, 40000, (length,), generator=torch.Generator().manual_seed(length)).tolist()]
    for length in (449, 459, 469)
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


def _kernel_attention(kernel: Any, sdpa: Any) -> Any:
    """transformers' SDPA attention function, but a one-token step's through the engine's kernel, as the lean
    step attends (``[rows, 1, heads, dim]`` out, as transformers' attention functions return)."""

    def attend(
        module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kwargs: Any
    ) -> Any:
        if query.shape[2] != 1:
            return sdpa(module, query, key, value, mask, **kwargs)
        # transformers' SDPA masks are boolean (True: attend); a float one would be read inverted.
        assert mask is None or mask.dtype == torch.bool, mask.dtype
        keep = None if mask is None else mask[..., : key.shape[-2]].reshape(mask.shape[0], -1)
        return kernel(query.contiguous(), key, value, keep, kwargs["scaling"]).transpose(1, 2).contiguous(), None

    return attend


def _fused_transformers(monkeypatch: pytest.MonkeyPatch, kernel: Any) -> None:
    """Make transformers' Llama norms and MLPs compute with the kernel's fused operations, as the lean step does."""
    from transformers.models.llama import modeling_llama as llama

    def norm(self: Any, hidden: torch.Tensor) -> torch.Tensor:
        return kernel.rms_norm(hidden.contiguous(), None, self.weight, self.variance_epsilon)

    def mlp(self: Any, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernel.silu_mul(torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)))

    monkeypatch.setattr(llama.LlamaRMSNorm, "forward", norm)
    monkeypatch.setattr(llama.LlamaMLP, "forward", mlp)


def _lean_step(decoder: LlamaDecoder, kv: KVBatch, tokens: list[int], positions: list[int]) -> torch.Tensor:
    assert kv.cache is not None
    mask = kv.step_mask()
    return decoder(torch.tensor(tokens).unsqueeze(1), torch.tensor(positions).unsqueeze(1), mask, kv.cache).float()


#: One row more than a bf16 step multiplies through the engine's kernel beside oneDNN with short prompts
#: (rows.bf16_kernel_wins: 5 where the kernel widens bf16, 33 where it multiplies bf16 natively).
_BESIDE = [(2, 0, 1)[i % 3] for i in range(rows_kernel.bf16_kernel_rows()[0] + 1)]


@pytest.mark.parametrize(
    ("weights", "tolerance"),
    # On the AMD EPYC VM both gave transformers' logits bit for bit (the stacked q/k/v and gate/up
    # products sum each output in the same order); the bounds leave room for another CPU's kernels.
    [("float32", 1e-5), ("bf16", 5e-3), ("int8", 5e-3), ("int4", 5e-3)],
)
@pytest.mark.parametrize(
    "rows",
    # Indices from 3 on are LONG_PROMPTS': five long rows take the kernel beside oneDNN, five short ones where
    # the kernel widens bf16 do not.
    [[0], [0, 0], [0, 1, 2], [2, 0, 1, 2, 1], _BESIDE, [3, 4, 5, 3, 4]],
    ids=["one row", "rows without padding", "padded rows", "five padded rows", "padded rows beside", "five long rows"],
)
def test_lean_steps_give_transformers_logits_and_kv(
    model_dir: Path, weights: WeightsMode, tolerance: float, rows: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = prepare_weights(load_model(model_dir), weights)
    decoder = llama_decoder(model)
    assert decoder is not None, "the default model (a LlamaForCausalLM) has no lean decode step"
    # The engine's own attention where every product goes through its kernel; SDPA for fp32 weights (whose 1e-5
    # it would not keep), int4 and oneDNN's bf16 steps of more rows.
    assert decoder.own_attention is (weights in ("bf16", "int8") and rows_kernel.decodes_here())
    prompts = [(PROMPTS + LONG_PROMPTS)[i] for i in rows]
    context = max(map(len, prompts))  # what each step attends to, within a few positions
    beside = weights == "bf16" and not rows_kernel.serves_every_bf16_decode()
    kernel_products = not beside or rows_kernel.bf16_kernel_wins(len(rows), context)
    attended: list[int] = []
    own = rows_kernel.decode_attention

    def counted(*args: Any) -> torch.Tensor:
        attended.append(1)
        return own(*args)

    monkeypatch.setattr(rows_kernel, "decode_attention", counted)
    # Where the kernel's products round activations to bf16 (a CPU with AVX-512 BF16), a bf16 rounding flipped by
    # the kernel's attention (~5e-7 from SDPA's) moves the logits by up to 0.15: bf16 activations resolve the
    # model no finer, whichever attention. There transformers' forward attends through the kernel too, so that
    # the lean step is checked against the same arithmetic (the kernel's attention against SDPA's: test_rows.py).
    rounded = weights == "bf16" and kernel_products and decoder.own_attention and rows_kernel.multiplies_bf16()
    if rounded:
        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", _kernel_attention(own, ALL_ATTENTION_FUNCTIONS["sdpa"]))
    # Steps of rounded weights take the kernel's fused norm and SiLU (checked against torch's operators in
    # test_rows.py); their fp32 differences flip bf16 roundings of the activations too (0.14-0.2 in logprobs),
    # so transformers' forward takes them as well and the lean step is checked against the same arithmetic.
    assert (decoder.fused is not None) is (weights != "float32" and rows_kernel.fused_elementwise() is not None)
    if decoder.fused is not None:
        _fused_transformers(monkeypatch, decoder.fused)
    # Transformers' forward multiplies through the same served layers: told the same context, they take the
    # lean step's products (the lean step tells them itself).
    with torch.inference_mode(), decode_step(positions=context):
        kv_hf, tokens, positions = _batch(model, prompts)
        kv_lean = copy.deepcopy(kv_hf)
        for _ in range(4):  # several steps: each appends to the cache the next one reads
            hf = _hf_step(model, kv_hf, tokens, positions)
            lean = _lean_step(decoder, kv_lean, tokens, positions)
            logprobs_hf, logprobs_lean = torch.log_softmax(hf, -1), torch.log_softmax(lean, -1)
            assert (logprobs_hf - logprobs_lean).abs().max().item() < tolerance
            tokens = hf.argmax(-1).tolist()
            positions = [p + 1 for p in positions]
    assert len(attended) == (4 * len(decoder.layers) if decoder.own_attention and kernel_products else 0)
    assert kv_hf.cache is not None and kv_lean.cache is not None
    for hf_layer, lean_layer in zip(kv_hf.cache.layers, kv_lean.cache.layers, strict=True):
        for a, b in zip(layer_kv(hf_layer), layer_kv(lean_layer), strict=True):
            assert a.shape == b.shape
            assert (a - b).abs().max().item() < tolerance


def _rounding_appends(kv: KVBatch) -> None:
    """Round every key and value the batch's layers append to bf16 (kept in fp32): what a bf16 batch holds."""
    assert kv.cache is not None

    def rounding(update: Any) -> Any:
        def rounded(key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return update(key.bfloat16().float(), value.bfloat16().float(), *args, **kwargs)

        return rounded

    for layer in kv.cache.layers:
        layer.update = rounding(layer.update)  # type: ignore[method-assign,union-attr]


@pytest.mark.parametrize("rows", [[0, 1, 2], _BESIDE], ids=["padded rows", "rows beside oneDNN"])
def test_lean_steps_on_a_bf16_batch_give_the_bits_of_the_same_values_in_fp32(model_dir: Path, rows: list[int]) -> None:
    # Where bf16 steps multiply natively through the kernel, the engine keeps its shared batch's KV in bf16
    # (LlamaDecoder.kv_dtype): the kernel widens each key and value exactly, and a step of more rows than it
    # takes widens them for SDPA. Either way a step must compute what it computes on fp32 values rounded alike.
    model = prepare_weights(load_model(model_dir), "bf16")
    decoder = llama_decoder(model)
    assert decoder is not None
    native = decoder.own_attention and rows_kernel.keeps_bf16_kv()
    assert decoder.kv_dtype == (torch.bfloat16 if native else torch.float32)
    if not native:
        pytest.skip("this CPU's bf16 steps keep fp32 KV (no AVX-512 BF16 or no kernel)")
    prompts = [PROMPTS[i] for i in rows]
    with torch.inference_mode(), decode_step(positions=max(map(len, prompts))):
        reference, tokens, positions = _batch(model, prompts)
        assert reference.cache is not None
        kv16 = KVBatch(torch.bfloat16)
        kv16.add_rows([cache_of(reference.row_kv(i), model.config) for i in range(len(prompts))])
        for layer in reference.cache.layers:  # the prefilled KV, rounded as the bf16 batch rounded it
            for tensor in layer_kv(layer):
                tensor.copy_(tensor.bfloat16().float())
        _rounding_appends(reference)
        for _ in range(3):
            expected = _lean_step(decoder, reference, tokens, positions)
            got = _lean_step(decoder, kv16, tokens, positions)
            assert torch.equal(got, expected)
            tokens, positions = expected.argmax(-1).tolist(), [p + 1 for p in positions]
    assert kv16.cache is not None
    for mine, theirs in zip(kv16.cache.layers, reference.cache.layers, strict=True):
        for a, b in zip(layer_kv(mine), layer_kv(theirs), strict=True):
            assert a.dtype == torch.bfloat16 and torch.equal(a.float(), b)


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
        model = plain.model  # a closed engine lets its weights go
    finally:
        plain.close()
    assert hf.output_ids == lean.output_ids
    reference = teacher_forced_logprobs(model, prompt, hf.output_ids, 0.0)
    assert max(abs(a - b) for a, b in zip(hf.output_logprobs, reference, strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(hf.output_logprobs, lean.output_logprobs, strict=True)) < 1e-4


def _own_caches(model: torch.nn.Module, prompts: list[list[int]]) -> list[DynamicCache]:
    caches = []
    for ids in prompts:
        cache = DynamicCache()
        model(torch.tensor([ids[:-1]]), cache=cache, use_cache=True)
        caches.append(cache)
    return caches


def _apart_steps(
    decoder: LlamaDecoder, caches: list[DynamicCache], tokens: list[int], positions: list[int], steps: int
) -> list[torch.Tensor]:
    """Logits ``[steps, vocab]`` of each row, its tokens fed greedily, all rows in each apart pass."""
    out: list[list[torch.Tensor]] = [[] for _ in tokens]
    for _ in range(steps):
        logits = decoder.apart(torch.tensor(tokens).unsqueeze(1), torch.tensor(positions).unsqueeze(1), caches)
        for row, values in enumerate(logits):
            out[row].append(values.clone())
        tokens = logits.argmax(-1).tolist()
        positions = [p + 1 for p in positions]
    return [torch.stack(rows) for rows in out]


@pytest.mark.parametrize("weights", ["float32", "bf16", "int8"])
def test_rows_decoded_apart_get_the_bits_of_any_other_such_pass(model_dir: Path, weights: WeightsMode) -> None:
    # The batch-invariant mode's rows share a pass only where this holds: a row's logits and KV are a
    # function of its own tokens, whatever rows decode beside it, however many, in whichever place.
    model = prepare_weights(load_model(model_dir), weights)
    decoder = llama_decoder(model)
    assert decoder is not None
    with torch.inference_mode(), decode_step():
        least = decoder.rows_apart
        if least is None:  # this CPU's products move rows: the engine decodes each alone, apart refuses
            with pytest.raises(ValueError, match="decode each alone"):
                decoder.apart(torch.tensor([[2]]), torch.tensor([[7]]), _own_caches(model, [PROMPTS[0]]))
            return
        alone = [
            _apart_steps(decoder, _own_caches(model, [ids]), [ids[-1]], [len(ids) - 1], steps=3)[0] for ids in PROMPTS
        ]
        crowd = [PROMPTS[2], PROMPTS[0], [1, 9, 8, 7, 6, 5, 4, 3, 2], PROMPTS[1], PROMPTS[2][:6]]
        caches = _own_caches(model, crowd)
        together = _apart_steps(decoder, caches, [ids[-1] for ids in crowd], [len(ids) - 1 for ids in crowd], steps=3)
        for row, prompt in ((1, 0), (3, 1), (0, 2)):
            assert torch.equal(together[row], alone[prompt]), f"row of prompt {prompt} moved with its neighbours"
        if least == 1:  # then a pass of one row is a plain one-row step, bit for bit
            kv, tokens, positions = _batch(model, [PROMPTS[0]])
            assert torch.equal(_lean_step(decoder, kv, tokens, positions), alone[0][0].float().unsqueeze(0))
        # The KV a row appends is its own too: decoded alone, it equals what it appended in the crowd.
        own = _own_caches(model, [PROMPTS[1]])[0]
        _apart_steps(decoder, [own], [PROMPTS[1][-1]], [len(PROMPTS[1]) - 1], steps=3)
        for mine, shared in zip(own.layers, caches[3].layers, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(layer_kv(mine), layer_kv(shared), strict=True))


class _SplitSum(torch.nn.Module):
    """A product that sums a row's inputs in two halves when it has more than ``alone_up_to`` rows
    beside it, as a CPU GEMM may block its sum by the row count (oneDNN's fp32 and bf16 products of
    1,536 inputs do, one row against several, on the AMD EPYC VM)."""

    def __init__(self, linear: torch.nn.Linear, alone_up_to: int) -> None:
        super().__init__()
        self.weight = linear.weight.detach()
        self.alone_up_to = alone_up_to

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.alone_up_to:
            return torch.cat([torch.nn.functional.linear(row, self.weight) for row in x])
        half = self.weight.shape[1] // 2
        first = torch.cat([torch.nn.functional.linear(row[..., :half], self.weight[:, :half]) for row in x])
        return first + torch.cat([torch.nn.functional.linear(row[..., half:], self.weight[:, half:]) for row in x])


class _OneRowApart(_SplitSum):
    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__(linear, alone_up_to=1)


class _FourRowsApart(_SplitSum):
    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__(linear, alone_up_to=4)


class _RowByRow(_SplitSum):
    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__(linear, alone_up_to=1_000)


def test_the_row_probe_finds_from_which_row_count_a_product_sums_a_row_alike() -> None:
    # Each product computes every row by itself; only the order of its sum changes with the row count
    # (an order the probe's bf16-exact weights and cancelling inputs must expose).
    from services.inference.llama_decode import row_invariant_from

    assert row_invariant_from(_RowByRow, 1536, 64) == 1
    assert row_invariant_from(_OneRowApart, 1536, 64) == 2  # a lone row then decodes in a pass of two
    assert row_invariant_from(_FourRowsApart, 1536, 64) is None  # rows must decode alone
