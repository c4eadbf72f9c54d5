"""Decode weights (services.inference.quant): what a decode step multiplies is what prefill multiplies."""

from __future__ import annotations

import pydantic
import pytest
import torch
from torch import nn

from services.inference import quant
from services.inference import rows as rows_kernel
from services.inference.quant import (
    INT4_GROUP,
    Bf16Linear,
    Fp32Linear,
    Int4Linear,
    Int8Linear,
    decode_step,
    dequantize_groups,
    prepare_weights,
    quantize_groups,
    quantize_rows,
)
from services.inference.settings import InferenceSettings
from spade import cpu_linear


def _linear(out_features: int = 48, in_features: int = 64, *, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


def test_each_row_is_rounded_to_its_own_scale() -> None:
    weight = torch.randn(6, 32, generator=torch.Generator().manual_seed(1))
    weight[2] *= 100.0  # one large row must not coarsen the others
    weight[4] = 0.0  # an all-zero row quantizes to zeros, not NaN
    q, scales = quantize_rows(weight)
    assert q.dtype == torch.int8 and scales.dtype == torch.bfloat16
    assert int(q.abs().max()) <= 127
    dequantized = q.float() * scales.float()[:, None]
    assert torch.equal(dequantized[4], torch.zeros(32))
    # Within half a step of the row's own scale (the scale itself is bf16-rounded first).
    assert bool(((dequantized - weight).abs() <= scales.float()[:, None] / 2 + 1e-7).all())
    assert float((dequantized[0] - weight[0]).abs().max()) < float(weight[2].abs().max()) / 127 / 10


def test_a_decode_step_and_a_prefill_multiply_the_same_weights() -> None:
    linear = _linear(bias=True)
    layer = Int8Linear(linear)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2))
    prefill = layer(x)  # outside a decode step: fp32 with the dequantized weights
    assert torch.equal(prefill, nn.functional.linear(x, layer.weight, layer.bias))
    # A one-token prefill (after a prefix-cache hit) is a prefill: the same fp32 path.
    torch.testing.assert_close(layer(x[:, -1:, :]), prefill[:, -1:, :], rtol=1e-5, atol=1e-6)
    with decode_step():
        decoded = layer(x[:, -1:, :])  # the int8 kernel on bf16 activations
    assert decoded.shape == (3, 1, 48) and decoded.dtype == torch.float32
    assert not torch.equal(decoded, prefill[:, -1:, :])
    # The kernel's only differences are the bf16 rounding of activations and outputs (~3 digits).
    torch.testing.assert_close(decoded, prefill[:, -1:, :], rtol=2e-2, atol=2e-2)
    # ... and the int8 model is the original one up to the weights' rounding.
    torch.testing.assert_close(prefill, linear(x).detach(), rtol=5e-2, atol=5e-2)


def test_a_decode_step_within_a_decode_step_leaves_the_outer_one_decoding() -> None:
    # The batch-invariant probe (llama_decode.row_invariant_from) opens one inside the engine's decode
    # step: leaving it must not turn the rest of the outer step into fp32 prefill products.
    layer = Int8Linear(_linear(bias=False))
    x = torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(5))
    with decode_step():
        decoded = layer(x)
        with decode_step():
            pass
        assert torch.equal(layer(x), decoded)
    assert not torch.equal(layer(x), decoded)


def test_every_linear_layer_is_replaced_and_nothing_else() -> None:
    inner = nn.Sequential(_linear(16, 48, seed=1), nn.ReLU())
    model = nn.Sequential(_linear(), nn.LayerNorm(48), inner)
    norm = model[1]
    prepare_weights(model, "int8")
    assert isinstance(model[0], Int8Linear) and isinstance(inner[0], Int8Linear)
    assert model[1] is norm and isinstance(inner[1], nn.ReLU)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    with decode_step():
        assert model(torch.randn(2, 1, 64)).shape == (2, 1, 16)


def test_weights_on_a_q4_1_grid_come_back_exactly_and_others_within_half_a_step() -> None:
    generator = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (8, 64), generator=generator)
    codes[:, ::INT4_GROUP] = 0  # every group spans its whole range, as a Q4_1 block that uses it
    codes[:, 1::INT4_GROUP] = 15
    scales = (torch.rand(8, 2, generator=generator) / 8 + 1 / 64).bfloat16().float()  # bf16 scales, as stored
    lows = -8 * scales  # zeros (low + 8 x scale) of 0: exact in bf16
    on_grid = (codes.view(8, 2, INT4_GROUP) * scales[..., None] + lows[..., None]).view(8, 64)
    found, scales_and_zeros = quantize_groups(on_grid)
    assert torch.equal(found, codes.to(torch.int32))
    assert torch.equal(dequantize_groups(found, scales_and_zeros), on_grid)

    weight = torch.randn(8, 64, generator=generator)
    found, scales_and_zeros = quantize_groups(weight)
    assert int(found.min()) >= 0 and int(found.max()) <= 15
    step = scales_and_zeros[..., 0].float().t().repeat_interleave(INT4_GROUP, dim=1)  # [out, in]
    assert bool(((dequantize_groups(found, scales_and_zeros) - weight).abs() <= step / 2 + 1e-6).all())


def test_an_int4_decode_step_and_a_prefill_multiply_the_same_weights() -> None:
    linear = _linear(bias=True)
    layer = Int4Linear(linear)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(4))
    prefill = layer(x)
    assert torch.equal(prefill, nn.functional.linear(x, layer.weight, layer.bias))
    with decode_step():
        decoded = layer(x[:, -1:, :])
    assert not torch.equal(decoded, prefill[:, -1:, :])
    torch.testing.assert_close(decoded, prefill[:, -1:, :], rtol=2e-2, atol=3e-2)


@pytest.mark.parametrize("native", [False, True], ids=["no native bf16", "native bf16"])
def test_a_bf16_decode_step_and_a_prefill_multiply_the_same_rounded_weights(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    dot = native and rows_kernel.multiplies_bf16()  # the kernel's product where the CPU multiplies bf16 natively
    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: native)
    monkeypatch.setattr(rows_kernel, "multiplies_bf16", lambda: dot)
    linear = _linear(bias=True)
    layer = Bf16Linear(linear)
    assert torch.equal(layer.weight, linear.weight.detach().to(torch.bfloat16).float())  # rounded once
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(5))
    fp32 = nn.functional.linear(x, layer.weight, layer.bias)
    with torch.inference_mode():
        prefill = layer(x)
        with decode_step():
            decoded = layer(x[:, -1:, :])
    assert decoded.dtype == prefill.dtype == torch.float32
    kernel = layer.rows and (layer.packed16 is None or rows_kernel.bf16_kernel_wins(3, 0))  # 3 rows decoded
    if kernel and dot:  # the engine's kernel (services.inference.rows), natively: bf16 activations, fp32 sums
        rounded = nn.functional.linear(x[:, -1:, :].bfloat16().float(), layer.weight, layer.bias)
        torch.testing.assert_close(decoded, rounded, rtol=1e-5, atol=1e-5)
    elif kernel:  # the engine's kernel: fp32 activations times the bf16 weights
        torch.testing.assert_close(decoded, fp32[:, -1:, :], rtol=1e-5, atol=1e-5)
    else:  # torch's: bf16 activations times the bf16 weights
        assert not torch.equal(decoded, fp32[:, -1:, :])
        torch.testing.assert_close(decoded, fp32[:, -1:, :], rtol=2e-2, atol=2e-2)
    assert layer.rows is rows_kernel.decodes_here()
    # With native bf16 a prefill is the decode step's product (bf16 activations, no fp32 copy kept for it);
    # without, the fp32 product of the same rounded weights.
    assert layer.kernel_prefills is native and (layer.prefill_packed is None) is (native or not cpu_linear.available())
    if native:
        assert not torch.equal(prefill, fp32)
        torch.testing.assert_close(prefill[:, -1:, :], decoded, rtol=1e-2, atol=1e-2)
    else:
        torch.testing.assert_close(prefill, fp32, rtol=1e-6, atol=1e-6)
    # With autograd (nothing the engine runs) the layer is fp32's F.linear either way.
    with torch.enable_grad():
        assert torch.equal(layer(x), fp32)
    # Finer than int8's per-row step: the rounded model is the original one to ~3 significant digits.
    int8_error = (Int8Linear(linear).weight - linear.weight.detach()).abs().mean()
    assert float((layer.weight - linear.weight.detach()).abs().mean()) < float(int8_error) / 2
    assert layer.decode_bytes() == 48 * 64 * 2 + 48 * 4


def test_bf16_replaces_every_linear_layer_the_lm_head_included() -> None:
    model = prepare_weights(_WithHead(), "bf16")
    assert all(isinstance(m, Bf16Linear) for m in (model.body[0], model.body[1], model.lm_head))
    assert not any(isinstance(m, nn.Linear) for m in model.modules())


class _WithHead(nn.Module):
    """A model with an LM head, as a Hugging Face causal LM names it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(_linear(64, 64), _linear(48, 40, seed=1))  # 40 inputs: not whole groups
        self.lm_head = _linear(100, 48, seed=2)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


def test_int4_keeps_the_lm_head_and_layers_of_partial_groups_at_int8() -> None:
    model = prepare_weights(_WithHead(), "int4")
    assert isinstance(model.body[0], Int4Linear)
    assert isinstance(model.body[1], Int8Linear)  # 40 inputs are not whole groups of 32
    assert isinstance(model.lm_head, Int8Linear)


needs_packing = pytest.mark.skipif(not cpu_linear.available(), reason="this torch has no oneDNN fp32 packing")


@needs_packing
def test_float32_packs_every_linear_layer_keeps_the_state_dict_and_refuses_unknown_modes() -> None:
    model = _WithHead()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert prepare_weights(model, "float32") is model
    assert [type(m) for m in (*model.body, model.lm_head)] == [Fp32Linear, Fp32Linear, Fp32Linear]
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    with pytest.raises(ValueError, match="unknown weights mode 'int2'; choose one of float32, bf16, int8, int4"):
        prepare_weights(model, "int2")  # type: ignore[arg-type]


@needs_packing
def test_float32_keeps_a_tied_head_tied() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(100, 48)
            self.lm_head = nn.Linear(48, 100, bias=False)
            self.lm_head.weight = self.embed.weight

    model = prepare_weights(Tied(), "float32")
    assert isinstance(model.lm_head, Fp32Linear) and model.lm_head.weight is model.embed.weight
    assert len(list(model.parameters())) == 1


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
def test_without_autograd_every_product_multiplies_the_packed_weights_and_with_it_the_layers_own(bias: bool) -> None:
    linear = _linear(96, 64, bias=bias, seed=3)
    layer = Fp32Linear(linear)
    for rows in (1, 2, 3, cpu_linear.PACK_ROWS, 16, 300):  # decode steps of any size and prefills
        x = torch.randn(rows, 1, 64, generator=torch.Generator().manual_seed(rows))
        plain = nn.functional.linear(x, linear.weight, linear.bias)
        assert torch.equal(layer(x), plain)  # with autograd (the learner's way): the layer's own product
        with torch.inference_mode():
            packed = layer(x)
        assert packed.shape == plain.shape
        torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)  # fp32 rounding only
    # The packed copy is what a pass without autograd reads (a stale copy would show): swap in zeros.
    layer.packed = cpu_linear.pack(torch.zeros(96, 64))
    x = torch.randn(5, 64)
    with torch.no_grad():
        expected = torch.zeros(5, 96) if linear.bias is None else linear.bias.detach().expand(5, 96)
        assert torch.equal(layer(x), expected)
    assert bool(layer(x).abs().sum() > 0)  # with autograd: the layer's own weights


def test_the_setting_names_its_choices() -> None:
    assert InferenceSettings().weights == "float32"
    assert InferenceSettings(weights="bf16").weights == "bf16"
    assert InferenceSettings(weights="int8").weights == "int8"
    assert InferenceSettings(weights="int4").weights == "int4"
    with pytest.raises(pydantic.ValidationError, match="'float32', 'bf16', 'int8' or 'int4'"):
        InferenceSettings(weights="int2")


@needs_packing
@pytest.mark.parametrize("kind", [Int8Linear, Int4Linear, Bf16Linear])
def test_a_quantized_layers_prefill_without_autograd_multiplies_its_packed_dequantized_weights(
    kind: type[Int8Linear] | type[Int4Linear] | type[Bf16Linear], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: False)  # bf16 prefills in fp32 (else: the test above)
    layer = kind(_linear(bias=True))
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        prefill = layer(x)
    torch.testing.assert_close(prefill, nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    layer.prefill_packed = cpu_linear.pack(torch.zeros(48, 64))  # a stale copy would show
    with torch.inference_mode():
        assert layer.bias is not None and torch.equal(layer(x), layer.bias.detach().expand(3, 5, 48))


@pytest.mark.skipif(not cpu_linear.packs_bf16(), reason="oneDNN packs no bf16 weights on this CPU")
def test_a_bf16_decode_step_multiplies_the_packed_bf16_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's product, not the engine's kernel
    monkeypatch.setattr(quant, "_use_rows_kernel", lambda inputs, outputs: False)
    layer = Bf16Linear(_linear(seed=7))
    x = torch.randn(4, 1, 64, generator=torch.Generator().manual_seed(7))
    with torch.inference_mode(), decode_step():
        decoded = layer(x)
        torch.testing.assert_close(
            decoded, nn.functional.linear(x.bfloat16(), layer.weight.bfloat16()).float(), rtol=1e-2, atol=1e-2
        )
        layer.packed16 = cpu_linear.pack(torch.zeros(48, 64), torch.bfloat16)
        assert torch.equal(layer(x), torch.zeros(4, 1, 48))
