"""The engine's own decode-step kernel (services.inference.rows): bf16 and int8 weights; fp32 activations, or bf16
ones multiplied natively where the CPU has AVX-512 BF16."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch import nn

from services.inference import llama_decode, rows
from services.inference.llama_decode import row_invariant_from
from services.inference.quant import Bf16Linear, Int8Linear, decode_step, stacked_product
from spade import cpu_linear

needs_kernel = pytest.mark.skipif(
    rows.kernel() is None, reason=f"the rows kernel is unavailable here: {rows.unavailable_reason()}"
)


def _inputs(count: int, inputs: int, seed: int) -> torch.Tensor:
    return torch.randn(count, inputs, generator=torch.Generator().manual_seed(seed))


def test_the_blocked_layout_puts_each_blocks_weights_of_a_group_of_inputs_side_by_side() -> None:
    weight = torch.arange(8 * 16, dtype=torch.int16).reshape(8, 16).to(torch.bfloat16)  # exact integers
    packed = rows.pack(weight)
    assert packed.shape == (2, 2, 4, 8) and packed.is_contiguous() and packed.dtype == torch.bfloat16
    for out in range(8):
        for inp in range(16):
            assert packed[out // 4, inp // 8, out % 4, inp % 8] == weight[out, inp]
    # Stacked layers (q, k and v; gate and up) concatenate their packed weights as their [out, in] ones.
    other = torch.randn(12, 16).bfloat16()
    assert torch.equal(torch.cat([packed, rows.pack(other)]), rows.pack(torch.cat([weight, other])))
    assert rows.out_features(packed) == 8
    for shape in ((8, 12), (6, 16)):
        assert not rows.fits(shape[1], shape[0])
        with pytest.raises(ValueError, match="whole blocks of 4 outputs and groups of 8 inputs"):
            rows.pack(torch.zeros(shape, dtype=torch.bfloat16))


_module = rows.kernel()
needs_bf16_dot = pytest.mark.skipif(
    _module is None or not _module.bf16_dot_supported(),
    reason="this CPU has no AVX-512 BF16 (VDPBF16PS) or the rows kernel is unavailable",
)
#: The kernel's two bf16 products: fp32 activations (every CPU it builds on), bf16 ones multiplied natively.
BF16_PRODUCTS = [
    pytest.param("bf16_rows", id="fp32 activations"),
    pytest.param("bf16_dot_rows", id="bf16 activations", marks=needs_bf16_dot),
]


def _product(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    module = rows.kernel()
    assert module is not None
    return cast(Callable[[torch.Tensor, torch.Tensor], torch.Tensor], getattr(module, name))


@needs_kernel
@pytest.mark.parametrize("count", [1, 2, 3, 4, 7, 16, 33])
@pytest.mark.parametrize(("outputs", "inputs"), [(48, 64), (52, 576), (8, 8)])
def test_bf16_rows_is_the_fp32_product_of_the_bf16_weights(count: int, outputs: int, inputs: int) -> None:
    weight16 = (torch.randn(outputs, inputs, generator=torch.Generator().manual_seed(1)) * 0.05).bfloat16()
    x = _inputs(count, inputs, 2)
    exact = x.double() @ weight16.double().t()
    y = _product("bf16_rows")(x, rows.pack(weight16))
    assert y.dtype == torch.float32 and y.shape == (count, outputs)
    # fp32 activations, not rounded to bf16 on the way: within fp32's rounding of the exact sums.
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5)
    rounded_inputs = x.bfloat16().double() @ weight16.double().t()
    assert (rounded_inputs - exact).abs().max() > 1e-4  # what torch's bf16 kernels (bf16 activations) compute


@needs_bf16_dot
@pytest.mark.parametrize("count", [1, 2, 3, 4, 7, 9, 16, 33])
@pytest.mark.parametrize(("outputs", "inputs"), [(48, 64), (52, 576), (8, 8), (4, 1544)])
def test_bf16_dot_rows_multiplies_the_activations_rounded_to_bf16(count: int, outputs: int, inputs: int) -> None:
    weight16 = (torch.randn(outputs, inputs, generator=torch.Generator().manual_seed(13)) * 0.05).bfloat16()
    x = _inputs(count, inputs, 14)
    y = _product("bf16_dot_rows")(x, rows.pack(weight16))
    assert y.dtype == torch.float32 and y.shape == (count, outputs)
    # The activations rounded to bf16 as torch rounds them (to nearest, ties to even), then fp32 sums.
    rounded_inputs = x.bfloat16().double() @ weight16.double().t()
    torch.testing.assert_close(y.double(), rounded_inputs, rtol=1e-5, atol=1e-5)
    assert (y.double() - x.double() @ weight16.double().t()).abs().max() > 1e-4  # not the fp32 activations'


@needs_kernel
@pytest.mark.parametrize("count", [1, 3, 4, 5, 9])
def test_int8_rows_is_the_product_of_the_codes_times_each_rows_scale(count: int) -> None:
    generator = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (52, 64), generator=generator, dtype=torch.int8)
    scales = torch.rand(52, generator=generator) * 0.01
    x = _inputs(count, 64, 4)
    exact = (x.double() @ q.double().t()) * scales.double()
    torch.testing.assert_close(rows.int8_rows(x, rows.pack(q), scales).double(), exact, rtol=1e-5, atol=1e-5)


@needs_bf16_dot
def test_the_native_product_flushes_denormal_activations_to_zero() -> None:
    # VCVTNEPS2BF16 and VDPBF16PS treat denormals as zero (documented in rows_kernel.cpp and docs/inference.md).
    weight16 = rows.pack(torch.randn(8, 16, generator=torch.Generator().manual_seed(17)).bfloat16())
    x = _inputs(2, 16, 18)
    tiny = x.clone()
    tiny[0, 3] = tiny[1, 9] = 1e-39  # a denormal fp32 (and bf16) value
    zeroed = x.clone()
    zeroed[0, 3] = zeroed[1, 9] = 0.0
    assert torch.equal(_product("bf16_dot_rows")(tiny, weight16), _product("bf16_dot_rows")(zeroed, weight16))


_GUARDED = """
import ctypes, mmap, torch
from services.inference import rows
page = mmap.PAGESIZE
buffer = mmap.mmap(-1, 2 * page)
libc = ctypes.CDLL(None, use_errno=True)
start = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
assert libc.mprotect(ctypes.c_void_p(start + page), page, 0) == 0, ctypes.get_errno()  # PROT_NONE: a read faults
weights = rows.pack(torch.randn(8, 8).bfloat16())
for count in (1, 3):  # 8 and 24 activations: a tail of 8 after no or one whole register of 16
    x = torch.frombuffer(buffer, dtype=torch.float32, count=8 * count, offset=page - 32 * count).view(count, 8)
    x.copy_(torch.randn(count, 8))
    y = rows.kernel().bf16_dot_rows(x, weights)
    torch.testing.assert_close(y, x.bfloat16().float() @ weights.permute(0, 2, 1, 3).reshape(8, 8).float().t())
print("read nothing past the activations")
"""


@needs_bf16_dot
def test_the_native_product_reads_nothing_past_its_activations() -> None:
    # The activations end where an unreadable page begins: rounding them reads the last few under a mask, and a
    # read past their end would kill the process (a process of its own, so that it is a failure, not a crash).
    done = subprocess.run([sys.executable, "-c", _GUARDED], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "read nothing past the activations" in done.stdout


@needs_bf16_dot
def test_the_kernel_multiplies_bf16_natively_where_the_cpu_can_unless_turned_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weight16 = rows.pack(torch.randn(16, 64, generator=torch.Generator().manual_seed(15)).bfloat16())
    x = _inputs(3, 64, 16)
    try:  # decided once a process: asked again here, whatever the environment the tests run in
        monkeypatch.delenv("SPADE_ROWS_BF16_DOT", raising=False)
        rows.multiplies_bf16.cache_clear()
        assert rows.multiplies_bf16()
        assert torch.equal(rows.bf16_rows(x, weight16), _product("bf16_dot_rows")(x, weight16))
        monkeypatch.setenv("SPADE_ROWS_BF16_DOT", "0")
        rows.multiplies_bf16.cache_clear()
        assert not rows.multiplies_bf16()
        assert torch.equal(rows.bf16_rows(x, weight16), _product("bf16_rows")(x, weight16))
    finally:
        monkeypatch.undo()
        rows.multiplies_bf16.cache_clear()


@needs_kernel
@pytest.mark.parametrize("product", BF16_PRODUCTS)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(product: str) -> None:
    multiply = _product(product)
    weight16 = rows.pack(torch.randn(52, 1536, generator=torch.Generator().manual_seed(5)).bfloat16())
    target = _inputs(1, 1536, 6)
    alone = multiply(target, weight16)[0]
    for count in (2, 3, 5, 8, 13, 32):
        for place in {0, count // 2, count - 1}:
            x = _inputs(count, 1536, 7 + count)
            x[place] = target[0]
            assert torch.equal(multiply(x, weight16)[place], alone), (count, place)


@needs_kernel
@pytest.mark.parametrize("product", BF16_PRODUCTS)
@pytest.mark.parametrize("outputs", [1536, 1540])
def test_every_thread_count_gives_the_same_bits(outputs: int, product: str) -> None:
    # The model's shapes split over threads (at::parallel_for, at least 16 blocks of 4 outputs a thread);
    # 1,540 outputs are 385 blocks, which no thread count splits evenly.
    multiply = _product(product)
    weight16 = (torch.randn(outputs, 576, generator=torch.Generator().manual_seed(11)) * 0.05).bfloat16()
    packed = rows.pack(weight16)
    x = _inputs(5, 576, 12)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = multiply(x, packed)
        torch.set_num_threads(4)
        four = multiply(x, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, four)
    activations = x if product == "bf16_rows" else x.bfloat16()
    torch.testing.assert_close(one.double(), activations.double() @ weight16.double().t(), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_leading_dimensions_are_kept_and_bad_shapes_are_refused_with_a_reason() -> None:
    weight16 = rows.pack(torch.randn(16, 64).bfloat16())
    x = torch.randn(3, 2, 64)
    assert rows.bf16_rows(x, weight16).shape == (3, 2, 16)
    module = rows.kernel()
    assert module is not None
    with pytest.raises(RuntimeError, match="multiple of 8"):
        module.bf16_rows(torch.randn(2, 60), weight16)
    with pytest.raises(RuntimeError, match="inputs"):
        rows.bf16_rows(torch.randn(2, 64), rows.pack(torch.randn(16, 72).bfloat16()))
    with pytest.raises(RuntimeError, match="bfloat16"):
        module.bf16_rows(torch.randn(2, 64), rows.pack(torch.randn(16, 64)))
    with pytest.raises(RuntimeError, match="blocked layout"):  # [out, in] weights, not packed
        module.bf16_rows(torch.randn(2, 64), torch.randn(16, 64).bfloat16())
    if module.bf16_dot_supported():  # the native product takes what the other takes, and refuses the rest alike
        with pytest.raises(RuntimeError, match="multiple of 8"):
            module.bf16_dot_rows(torch.randn(2, 60), weight16)
        with pytest.raises(RuntimeError, match="blocked layout"):
            module.bf16_dot_rows(torch.randn(2, 64), torch.randn(16, 64).bfloat16())
        with pytest.raises(RuntimeError, match="bfloat16"):
            module.bf16_dot_rows(torch.randn(2, 64), rows.pack(torch.randn(16, 64)))
        with pytest.raises(RuntimeError, match="float32"):
            module.bf16_dot_rows(torch.randn(2, 64).double(), weight16)
    with pytest.raises(RuntimeError, match="one per output"):
        module.int8_rows(torch.randn(2, 64), rows.pack(torch.zeros(16, 64, dtype=torch.int8)), torch.ones(15))
    assert not rows.fits(60, 16) and rows.fits(64, 16)


@pytest.fixture
def no_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU like the AVX2 VM's, wherever the test runs: no native bf16, and oneDNN packs no bf16."""
    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: False)
    monkeypatch.setattr(cpu_linear, "packs_bf16", lambda: False)
    monkeypatch.setattr(rows, "multiplies_bf16", lambda: False)


@needs_kernel
@pytest.mark.usefixtures("no_native_bf16")
@pytest.mark.parametrize("bias", [False, True])
def test_without_native_bf16_a_bf16_layer_decodes_fp32_activations_through_the_kernel(bias: bool) -> None:
    linear = nn.Linear(64, 48, bias=bias)
    layer = Bf16Linear(linear)
    assert layer.rows and layer.packed16 is None and layer.weight16 is None and layer.rows16 is not None
    x = torch.randn(4, 1, 64, generator=torch.Generator().manual_seed(8))
    fp32 = nn.functional.linear(x, layer.weight, layer.bias)  # the same rounded weights, in fp32
    with torch.inference_mode(), decode_step():
        decoded = layer(x)
        torch.testing.assert_close(decoded, fp32, rtol=1e-5, atol=1e-5)
        layer.rows16 = rows.pack(torch.zeros(48, 64, dtype=torch.bfloat16))  # the step reads rows16, nothing else
        zeros = torch.zeros(4, 1, 48) if layer.bias is None else layer.bias.detach().expand(4, 1, 48)
        assert torch.equal(layer(x), zeros)


@needs_kernel
@pytest.mark.usefixtures("no_native_bf16")
def test_the_engines_probe_finds_bf16_and_int8_layers_row_invariant_from_one_row() -> None:
    # Adversarial inputs whose sums change with the order of summation (llama_decode.row_invariant_from);
    # shapes of their own, since the probe's answers are kept per process.
    assert row_invariant_from(Bf16Linear, 1536, 52) == 1
    assert row_invariant_from(Int8Linear, 1536, 52) == 1


@needs_kernel
@pytest.mark.usefixtures("no_native_bf16")
def test_without_native_bf16_an_int8_layer_decodes_fp32_activations_through_the_kernel() -> None:
    layer = Int8Linear(nn.Linear(64, 48, bias=False))
    assert layer.rows_scales is not None and layer.rows_qweight is not None and layer.qweight is None
    x = torch.randn(3, 1, 64, generator=torch.Generator().manual_seed(9))
    with torch.inference_mode(), decode_step():
        decoded = layer(x)
        # The dequantized weights (what prefills multiply) times fp32 activations.
        torch.testing.assert_close(decoded, nn.functional.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
        layer.rows_qweight = rows.pack(torch.zeros(48, 64, dtype=torch.int8))  # the step reads these codes
        assert torch.equal(layer(x), torch.zeros(3, 1, 48))
    assert layer.decode_bytes() == 48 * 64 + 48 * 2  # a byte a weight, a bf16 scale a row


@needs_kernel
@pytest.mark.usefixtures("no_native_bf16")
@pytest.mark.parametrize("kind", [Bf16Linear, Int8Linear])
def test_stacked_layers_decode_through_the_kernel_as_each_layer_does(kind: type[Bf16Linear] | type[Int8Linear]) -> None:
    layers = [kind(nn.Linear(64, out, bias=False)) for out in (32, 8, 8)]
    stacked = stacked_product(layers)
    assert stacked is not None
    x = torch.randn(5, 1, 64, generator=torch.Generator().manual_seed(10))
    with torch.inference_mode(), decode_step():
        each = torch.cat([layer(x) for layer in layers], dim=-1)
        assert torch.equal(stacked(x), each)  # the same sums in the same order: bit for bit


needs_onednn_bf16 = pytest.mark.skipif(
    not cpu_linear.packs_bf16(), reason="oneDNN packs no bf16 weights on this CPU (AVX2 without AVX-512)"
)


def _took(product: nn.Module, x: torch.Tensor) -> str:
    """Which product a bf16 layer took: with its kernel's weights zeroed, the kernel gives zeros, oneDNN not."""
    y = product(x)
    return "kernel" if torch.equal(y, torch.zeros_like(y)) else "onednn"


@needs_kernel
@needs_onednn_bf16
def test_beside_onednn_a_bf16_layer_decodes_few_rows_or_long_contexts_through_the_kernel() -> None:
    layer = Bf16Linear(nn.Linear(64, 48, bias=False))
    assert layer.rows and layer.rows16 is not None and layer.packed16 is not None
    assert not rows.serves_every_bf16_decode()
    (few, many), long = rows.bf16_kernel_rows(), rows.BF16_LONG_POSITIONS
    generator = torch.Generator().manual_seed(11)
    with torch.inference_mode():
        for count in range(1, few + 1):  # within fp32 rounding of the product of the kernel's activations
            x = torch.randn(count, 1, 64, generator=generator)
            activations = x.bfloat16().float() if rows.multiplies_bf16() else x  # native bf16: rounded
            with decode_step():
                expected = nn.functional.linear(activations, layer.weight)
                torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
        layer.rows16 = rows.pack(torch.zeros(48, 64, dtype=torch.bfloat16))
        x = torch.randn(many + 1, 1, 64, generator=generator)
        with decode_step():  # the context unknown: a few rows only
            assert _took(layer, x[:few]) == "kernel"
            assert _took(layer, x[: few + 1]) == "onednn"  # one row more: oneDNN's packed bf16
        with decode_step(positions=long - 1):
            assert _took(layer, x[: few + 1]) == "onednn"
        with decode_step(positions=long):  # a long context: the kernel's attention pays for more rows
            assert _took(layer, x[:many]) == "kernel"
            assert _took(layer, x) == "onednn"
            with decode_step():  # nested, the context not told again: the outer step's
                assert _took(layer, x[:many]) == "kernel"
        with decode_step(invariant=True):  # one product at every count: oneDNN's, one row too
            assert _took(layer, x[:1]) == "onednn"
            with decode_step(positions=long):  # nested in an invariant step: still invariant
                assert _took(layer, x[:1]) == "onednn"
        with decode_step():
            assert _took(layer, x[:1]) == "kernel"  # the invariant step's setting did not outlive it
        if layer.kernel_prefills:  # native bf16: a prefill of one token takes a prefill's product, oneDNN's
            assert _took(layer, x[:1]) == "onednn"


def test_the_kernel_takes_more_rows_beside_onednn_where_it_multiplies_bf16_natively(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    long = rows.BF16_LONG_POSITIONS
    for native, (few, many) in (
        (True, (rows.BF16_NATIVE_MOST_ROWS, rows.BF16_NATIVE_LONG_MOST_ROWS)),
        (False, (rows.BF16_MOST_ROWS, rows.BF16_LONG_MOST_ROWS)),
    ):
        monkeypatch.setattr(rows, "multiplies_bf16", lambda native=native: native)
        assert rows.bf16_kernel_rows() == (few, many) and few < many
        assert rows.bf16_kernel_wins(few, 0) and not rows.bf16_kernel_wins(few + 1, 0)
        assert rows.bf16_kernel_wins(many, long) and not rows.bf16_kernel_wins(many, long - 1)
        assert not rows.bf16_kernel_wins(many + 1, long)


@needs_kernel
@needs_onednn_bf16
def test_beside_onednn_stacked_bf16_layers_choose_their_product_as_each_layer_does() -> None:
    layers = [Bf16Linear(nn.Linear(64, out, bias=False)) for out in (32, 8, 8)]
    stacked = stacked_product(layers)
    assert stacked is not None
    generator = torch.Generator().manual_seed(12)
    with torch.inference_mode():
        few, many = rows.bf16_kernel_rows()  # the kernel's counts, then oneDNN's (rows.bf16_kernel_wins)
        cases = [(1, False, 0), (few, False, 0), (few + 1, False, 0), (many, False, 512), (many + 1, False, 512)]
        cases += [(1, True, 0), (5, True, 512)]
        for count, invariant, positions in cases:
            x = torch.randn(count, 1, 64, generator=generator)
            with decode_step(invariant=invariant, positions=positions):
                assert torch.equal(stacked(x), torch.cat([layer(x) for layer in layers], dim=-1))


@needs_kernel
@needs_onednn_bf16
def test_beside_onednn_the_probe_takes_the_products_of_batch_invariant_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel for a few rows and oneDNN for more would give a row other bits at 5 rows than at 2: the
    # probe multiplies as batch-invariant steps do, oneDNN's product at every count, never the kernel.
    def refused(*_: object) -> torch.Tensor:
        raise AssertionError("a batch-invariant bf16 step took the kernel beside oneDNN")

    monkeypatch.setattr(llama_decode, "_probes", {})  # probed anew, not an answer kept from another test
    monkeypatch.setattr(rows, "bf16_rows", refused)
    row_invariant_from(Bf16Linear, 1536, 44)
    monkeypatch.undo()
    assert row_invariant_from(Int8Linear, 1536, 44) == 1  # int8: the kernel at every count


@needs_kernel
def test_the_kernel_takes_every_bf16_decode_only_where_onednn_packs_no_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the run's default weights follow (services/embedded/system.py served_weights).
    for packs in (False, True):
        monkeypatch.setattr(cpu_linear, "packs_bf16", lambda packs=packs: packs)
        assert rows.serves_every_bf16_decode() is not packs


@needs_kernel
@pytest.mark.usefixtures("no_native_bf16")
def test_turned_off_the_layers_keep_torchs_products(monkeypatch: pytest.MonkeyPatch) -> None:
    assert rows.decodes_here() and rows.unavailable_reason() is None
    rows.kernel.cache_clear()
    try:
        monkeypatch.setenv("SPADE_ROWS_KERNEL", "0")
        assert rows.kernel() is None and "SPADE_ROWS_KERNEL" in str(rows.unavailable_reason())
        assert not Bf16Linear(nn.Linear(64, 48)).rows
        assert Int8Linear(nn.Linear(64, 48)).rows_scales is None
    finally:
        rows.kernel.cache_clear()
        monkeypatch.delenv("SPADE_ROWS_KERNEL")
        assert rows.kernel() is not None  # loaded again, as built, for the tests after this one
        assert rows.unavailable_reason() is None


_UNBUILDABLE = """
from services.inference import rows
from services.inference.quant import Bf16Linear, Int8Linear, decode_step, stacked_product
from spade import cpu_linear
import torch
from torch import nn
cpu_linear.native_bf16 = lambda: False
cpu_linear.packs_bf16 = lambda: False  # the AVX2 VM's CPU, wherever this runs
x = torch.randn(2, 1, 64)
int8 = Int8Linear(nn.Linear(64, 48, bias=False))
bf16 = Bf16Linear(nn.Linear(64, 48, bias=False))
assert rows.kernel() is None and not rows.decodes_here(), rows.unavailable_reason()
assert int8.rows_scales is None and int8.rows_qweight is None and int8.qweight is not None
assert not bf16.rows and bf16.packed16 is None and bf16.rows16 is None and bf16.weight16 is not None
assert stacked_product([bf16, Bf16Linear(nn.Linear(64, 16, bias=False))]) is None  # each layer's own product
with torch.inference_mode(), decode_step():  # torch's products: int8's kernel, bf16's F.linear
    for layer in (int8, bf16):
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight), rtol=3e-2, atol=3e-2)
print(rows.unavailable_reason())
"""


@pytest.mark.slow
def test_where_the_kernel_cannot_be_built_the_layers_keep_torchs_products(tmp_path: Path) -> None:
    # A process of its own: torch builds an extension again, under another name, once its build settings change.
    env = {**os.environ, "SPADE_KERNEL_CACHE": str(tmp_path), "CXX": str(tmp_path / "no-compiler")}
    done = subprocess.run(
        [sys.executable, "-c", _UNBUILDABLE], check=False, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "building rows_kernel.cpp failed" in done.stdout and "no-compiler" in done.stdout + done.stderr


def _attention_case(rows_: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A one-token query of 9 heads on 3 key/value heads (SmolLM2's), keys and values views of a longer buffer."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(rows_, 9, 1, 64, generator=generator)
    buffer = torch.randn(2, rows_, 3, length + 13, 64, generator=generator)
    return query, buffer[0, :, :, :length], buffer[1, :, :, :length]


def _sdpa64(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    mask = None if keep is None else keep[:, None, None, :]
    grouped = query.double().reshape(query.shape[0], 3, 3, 64)
    out = nn.functional.scaled_dot_product_attention(grouped, key.double(), value.double(), attn_mask=mask, scale=0.125)
    return out.reshape(query.shape)


@needs_kernel
@pytest.mark.parametrize(("count", "length"), [(1, 1), (1, 7), (2, 37), (4, 600), (3, 1031)])
@pytest.mark.parametrize("padded", [False, True])
def test_decode_attention_is_grouped_query_attention_over_the_kept_positions(
    count: int, length: int, padded: bool
) -> None:
    query, key, value = _attention_case(count, length, 20 + length)
    keep = None
    if padded:  # the engine's left padding: row 0 starts a third of the way in
        keep = torch.ones(count, length, dtype=torch.bool)
        keep[0, : length // 3] = False
    out = rows.decode_attention(query, key, value, keep, 0.125)
    assert out.shape == query.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _sdpa64(query, key, value, keep), rtol=1e-5, atol=2e-6)
    if padded and length > 3:  # what the padding holds does not reach the row
        key[0, :, : length // 3] = 1e4
        value[0, :, : length // 3] = float("nan")
        assert torch.equal(rows.decode_attention(query, key, value, keep, 0.125), out)


@needs_kernel
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(4, 4, 64), (4, 1, 32), (5, 1, 48), (7, 1, 16), (8, 2, 64), (6, 1, 80)]
)
def test_decode_attention_takes_any_group_of_query_heads_and_any_head_dim(heads: int, kv_heads: int, dim: int) -> None:
    # A pass over a key/value head's keys and values serves up to three of its query heads at once: groups of
    # 1, 4, 5, 6 and 7 heads take one pass or several, the last with fewer heads; 16, 48 and 80 dims take the
    # values 16 at a time, 32 and 64 32 at a time.
    generator = torch.Generator().manual_seed(heads * 100 + dim)
    query = torch.randn(3, heads, 1, dim, generator=generator)
    key, value = (torch.randn(3, kv_heads, 45, dim, generator=generator) for _ in range(2))
    keep = torch.rand(3, 45, generator=generator) > 0.2
    out = rows.decode_attention(query, key, value, keep, dim**-0.5)
    group = heads // kv_heads
    exact = nn.functional.scaled_dot_product_attention(
        query.double().reshape(3, kv_heads, group, dim),
        key.double(),
        value.double(),
        attn_mask=keep[:, None, None, :],
        scale=dim**-0.5,
    ).reshape(query.shape)
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "length"),
    [(9, 3, 64, 203), (4, 4, 64, 37), (4, 1, 32, 45), (5, 1, 48, 45), (7, 1, 16, 45), (8, 2, 64, 3)],
)
def test_decode_attention_reads_bf16_keys_and_values_as_the_fp32_values_they_widen_to(
    heads: int, kv_heads: int, dim: int, length: int
) -> None:
    # The engine's shared lane keeps bf16 KV where its bf16 steps multiply natively: the kernel widens each key
    # and value exactly, so it attends to bf16 KV bit for bit as to the same values in fp32, whatever the group
    # (passes of 1 to 3 heads) and the head dim; row 1 has padding, row 2 no kept position at all.
    generator = torch.Generator().manual_seed(heads * 10 + dim + length)
    query = torch.randn(4, heads, 1, dim, generator=generator)
    buffer = torch.randn(2, 4, kv_heads, length + 7, dim, generator=generator).bfloat16()
    key16, value16 = buffer[..., :length, :]  # views of a longer buffer
    assert key16.dtype == torch.bfloat16 and not key16.is_contiguous()
    keep = torch.ones(4, length, dtype=torch.bool)
    keep[1, : length // 2] = False
    keep[2] = False
    out = rows.decode_attention(query, key16, value16, keep, dim**-0.5)
    assert torch.equal(out, rows.decode_attention(query, key16.float(), value16.float(), keep, dim**-0.5))
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    unrounded = rows.decode_attention(query, key16.float() * (1 + 2**-10), value16.float(), keep, dim**-0.5)
    assert not torch.equal(out, unrounded)  # what it reads is what the bf16 buffer holds, not something near it
    exact = nn.functional.scaled_dot_product_attention(
        query.double().reshape(4, kv_heads, heads // kv_heads, dim),
        key16.double(),
        value16.double(),
        attn_mask=keep[:, None, None, :],
        scale=dim**-0.5,
    ).reshape(query.shape)
    torch.testing.assert_close(out[[0, 1, 3]].double(), exact[[0, 1, 3]], rtol=1e-5, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_gives_a_head_the_same_bits_whichever_heads_share_its_pass(dtype: torch.dtype) -> None:
    # A pass over the keys and values serves up to three query heads of a group: a head's bits must not depend on
    # which heads (or how many) it is computed beside.
    generator = torch.Generator().manual_seed(80)
    query = torch.randn(2, 7, 1, 64, generator=generator)
    key, value = (torch.randn(2, 1, 150, 64, generator=generator).to(dtype) for _ in range(2))
    together = rows.decode_attention(query, key, value, None, 0.125)
    for head in range(7):
        alone = rows.decode_attention(query[:, head : head + 1].contiguous(), key, value, None, 0.125)
        assert torch.equal(alone, together[:, head : head + 1]), head


@needs_kernel
def test_decode_attention_gives_a_row_the_same_bits_beside_any_rows() -> None:
    query, key, value = _attention_case(5, 300, 31)
    together = rows.decode_attention(query, key, value, None, 0.125)
    for row in range(5):
        alone = rows.decode_attention(query[row : row + 1], key[row : row + 1], value[row : row + 1], None, 0.125)
        assert torch.equal(alone, together[row : row + 1]), row
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(rows.decode_attention(query, key, value, None, 0.125), together)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_decode_attention_refuses_what_it_cannot_attend_with_a_reason() -> None:
    query, key, value = _attention_case(2, 16, 40)
    module = rows.kernel()
    assert module is not None
    with pytest.raises(RuntimeError, match="float32"):
        module.decode_attention(query, key.double(), value, None, 0.125)
    with pytest.raises(RuntimeError, match="both be float32 or both bfloat16"):
        module.decode_attention(query, key.bfloat16(), value, None, 0.125)
    with pytest.raises(RuntimeError, match="both be float32 or both bfloat16"):
        module.decode_attention(query, key.half(), value.half(), None, 0.125)
    with pytest.raises(RuntimeError, match="the query must be float32"):
        module.decode_attention(query.bfloat16(), key, value, None, 0.125)
    with pytest.raises(RuntimeError, match="multiple of the key/value heads"):
        module.decode_attention(torch.randn(2, 8, 1, 64), key, value, None, 0.125)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        module.decode_attention(
            torch.randn(2, 9, 1, 40), torch.randn(2, 3, 16, 40), torch.randn(2, 3, 16, 40), None, 1.0
        )
    with pytest.raises(RuntimeError, match="contiguous"):
        module.decode_attention(query, key.transpose(2, 3).contiguous().transpose(2, 3), value, None, 0.125)
    with pytest.raises(RuntimeError, match=r"\[rows, length\]"):
        module.decode_attention(query, key, value, torch.ones(2, 15, dtype=torch.bool), 0.125)
    assert rows.attention_fits(64) and not rows.attention_fits(40)


@needs_kernel
def test_decode_attention_gives_a_row_the_same_bits_whatever_its_padding() -> None:
    # The engine re-pads its rows as others join and leave (services.inference.kv): a row's attention,
    # its sum of exps included, must not move with the padding in front of it.
    query, key, value = _attention_case(1, 203, 50)
    alone = rows.decode_attention(query, key, value, None, 0.125)
    for padding in (1, 5, 8, 13):
        generator = torch.Generator().manual_seed(padding)
        pad = torch.randn(2, 1, 3, padding, 64, generator=generator)
        keep = torch.ones(1, padding + 203, dtype=torch.bool)
        keep[0, :padding] = False
        padded = rows.decode_attention(
            query, torch.cat([pad[0], key], dim=2), torch.cat([pad[1], value], dim=2), keep, 0.125
        )
        assert torch.equal(padded, alone), padding


@needs_kernel
def test_decode_attention_with_heads_of_80_dims_and_its_edges() -> None:
    generator = torch.Generator().manual_seed(60)
    query, key, value = (torch.randn(2, h, n, 80, generator=generator) for h, n in ((4, 1), (2, 21), (2, 21)))
    out = rows.decode_attention(query, key, value, None, 0.1)  # 80 dims: 16 at a time, not 64
    exact = nn.functional.scaled_dot_product_attention(
        query.double().reshape(2, 2, 2, 80), key.double(), value.double(), scale=0.1
    ).reshape(query.shape)
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=2e-6)
    nothing = torch.zeros(2, 21, dtype=torch.bool)  # no kept position: zeros (SDPA: NaN)
    assert torch.equal(rows.decode_attention(query, key, value, nothing, 0.1), torch.zeros_like(query))
    key[1, 0, 3] = float("nan")  # a NaN reaches the heads that read it, as in SDPA
    poisoned = rows.decode_attention(query, key, value, None, 0.1)
    assert bool(poisoned[1, :2].isnan().all()) and not bool(poisoned[0].isnan().any())
    assert not bool(poisoned[1, 2:].isnan().any())


def _fused() -> Any:
    module = rows.fused_elementwise()
    assert module is not None
    return module


#: The lean step's elementwise operations: the kernel's fused ones, and torch's (fp32 weights, no kernel).
OPS = [pytest.param("kernel", marks=needs_kernel), "torch"]


def _ops(name: str) -> Any:
    return _fused() if name == "kernel" else llama_decode._TorchOps


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("dim", [576, 64, 20])
def test_the_norm_is_llamas_rms_norm_and_adds_the_residual_in_place(ops: str, dim: int) -> None:
    generator = torch.Generator().manual_seed(dim)
    hidden = torch.randn(5, 1, dim, generator=generator) * 3
    delta = torch.randn(5, 1, 2 * dim, generator=generator)[..., ::2]  # not contiguous: taken as it is
    weight = torch.rand(dim, generator=generator) + 0.5
    norm = _ops(ops).rms_norm
    plain = norm(hidden.clone(), None, weight, 1e-5)
    torch.testing.assert_close(plain, llama_decode._rms_norm(hidden, weight, 1e-5), rtol=2e-6, atol=1e-6)
    stream = hidden.clone()
    normed = norm(stream, delta, weight, 1e-5)
    assert torch.equal(stream, hidden + delta)  # the residual stream, added in place as torch adds
    torch.testing.assert_close(normed, llama_decode._rms_norm(hidden + delta, weight, 1e-5), rtol=2e-6, atol=1e-6)
    for row in range(5):  # a row's bits are its own
        alone = norm(hidden[row : row + 1].clone(), delta[row : row + 1], weight, 1e-5)
        assert torch.equal(alone, normed[row : row + 1])


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize(("heads", "rotated", "dim"), [(15, 12, 64), (4, 3, 20), (2, 2, 288)])
def test_the_rotary_embedding_gives_transformers_bits_and_leaves_the_values_alone(
    ops: str, heads: int, rotated: int, dim: int
) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    generator = torch.Generator().manual_seed(heads + dim)
    qkv = torch.randn(3, 1, heads * dim, generator=generator)
    # Each half of cos and sin its own (the model's repeat one half; a kernel that read the wrong half would pass).
    cos, sin = (torch.rand(3, dim, generator=generator) * 2 - 1 for _ in range(2))
    expected = qkv.view(3, heads, 1, dim).clone()
    rotated_part, _ = apply_rotary_pos_emb(
        expected[:, :rotated], expected[:, :rotated], cos.unsqueeze(1), sin.unsqueeze(1)
    )
    expected[:, :rotated] = rotated_part
    _ops(ops).rotate(qkv, heads, rotated, cos, sin)
    assert torch.equal(qkv.view(3, heads, 1, dim), expected)


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("intermediate", [1536, 13])
def test_silu_multiplies_the_gate_by_the_up_projection(ops: str, intermediate: int) -> None:
    generator = torch.Generator().manual_seed(intermediate)
    gate_up = torch.randn(4, 1, 2 * intermediate, generator=generator) * 6
    gate_up[0, 0, :3] = torch.tensor([-200.0, 200.0, 0.0])  # far beyond exp's range either way
    gate, up = gate_up.chunk(2, dim=-1)
    out = _ops(ops).silu_mul(gate_up)
    assert out.shape == (4, 1, intermediate)
    torch.testing.assert_close(out, nn.functional.silu(gate) * up, rtol=2e-6, atol=1e-7)
    for row in range(4):
        assert torch.equal(_ops(ops).silu_mul(gate_up[row : row + 1]), out[row : row + 1])


@needs_kernel
def test_the_fused_operations_refuse_what_they_cannot_compute() -> None:
    kernel = _fused()
    with pytest.raises(RuntimeError, match="contiguous float32"):
        kernel.rms_norm(torch.randn(2, 8).double(), None, torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match=r"weight must be a contiguous float32 \[8\]"):
        kernel.rms_norm(torch.randn(2, 8), None, torch.ones(9), 1e-5)
    with pytest.raises(RuntimeError, match="shape"):
        kernel.rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        kernel.rms_norm(torch.randn(8, 2).t(), None, torch.ones(8), 1e-5)  # normed in place: must be contiguous
    with pytest.raises(RuntimeError, match=r"\[rows, 3 \* 4\]"):
        kernel.rotate(torch.randn(2, 13), 3, 2, torch.ones(2, 4), torch.ones(2, 4))
    with pytest.raises(RuntimeError, match="rotated heads must be 0 to heads"):
        kernel.rotate(torch.randn(2, 12), 3, 4, torch.ones(2, 4), torch.ones(2, 4))
    with pytest.raises(RuntimeError, match="2 \\* intermediate"):
        kernel.silu_mul(torch.randn(2, 7))


@needs_kernel
def test_the_fused_operations_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPADE_ROWS_FUSED", raising=False)
    assert rows.fused_elementwise() is rows.kernel()
    monkeypatch.setenv("SPADE_ROWS_FUSED", "0")
    assert rows.fused_elementwise() is None
    monkeypatch.setenv("SPADE_ROWS_FUSED", "1")
    assert rows.fused_elementwise() is rows.kernel()


@pytest.mark.parametrize("native", [False, True])
def test_bf16_kv_is_kept_only_where_bf16_multiplies_natively_and_can_be_turned_off(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    monkeypatch.setattr(rows, "multiplies_bf16", lambda: native)
    monkeypatch.delenv("SPADE_ROWS_BF16_KV", raising=False)
    assert rows.keeps_bf16_kv() is native
    monkeypatch.setenv("SPADE_ROWS_BF16_KV", "0")
    assert not rows.keeps_bf16_kv()
