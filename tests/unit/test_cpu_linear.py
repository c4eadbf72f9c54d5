"""oneDNN fp32 linear layers (spade.cpu_linear): F.linear's values and gradients, by oneDNN's products."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spade import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch has no oneDNN for the CPU")


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Record the shape of every oneDNN product's input."""
    calls: list[tuple[int, ...]] = []
    real = cpu_linear._product

    def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return real(x, weight, bias)

    monkeypatch.setattr(cpu_linear, "_product", product)
    return calls


@pytest.mark.parametrize("bias", [False, True])
def test_values_and_gradients_are_f_linears_from_three_onednn_products(
    bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 64, generator=gen) * 0.1).requires_grad_()
    b = torch.randn(96, generator=gen).requires_grad_() if bias else None
    x = torch.randn(2, 37, 64, generator=gen).requires_grad_()
    grad_out = torch.randn(2, 37, 96, generator=gen)

    expected = nn.functional.linear(x, w, b)
    expected.backward(grad_out)
    want = [t.grad.clone() for t in (x, w, b) if t is not None and t.grad is not None]
    for t in (x, w, b):
        if t is not None:
            t.grad = None

    calls = _counting(monkeypatch)
    got = cpu_linear.linear(x, w, b)
    got.backward(grad_out)
    assert calls == [(2, 37, 64), (2, 37, 96), (96, 74)]  # forward, input gradient, weight gradient
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    have = [t.grad for t in (x, w, b) if t is not None and t.grad is not None]
    assert len(have) == len(want) == (3 if bias else 2)
    for g, e in zip(have, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-4)


def test_only_the_gradients_asked_for_are_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(8, 4).requires_grad_()
    x = torch.randn(3, 4)  # an input that needs no gradient (token embeddings do not flow back here)
    calls = _counting(monkeypatch)
    cpu_linear.linear(x, w).sum().backward()
    assert calls == [(3, 4), (8, 3)]
    torch.testing.assert_close(w.grad, torch.ones(3, 8).t() @ x)


def test_anything_but_fp32_on_the_cpu_without_autocast_is_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting(monkeypatch)
    w, x = torch.randn(8, 4), torch.randn(3, 4)
    assert torch.equal(cpu_linear.linear(x.bfloat16(), w.bfloat16()), nn.functional.linear(x.bfloat16(), w.bfloat16()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = cpu_linear.linear(x, w)
    assert under.dtype == torch.bfloat16  # autocast still decides, as it would for F.linear
    assert calls == []
    cpu_linear.linear(x, w)
    assert calls == [(3, 4)]


def test_a_model_keeps_its_parameters_and_state_dict_and_multiplies_with_onednn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2, bias=False))
    params = list(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plain = model(torch.ones(5, 4))
    assert cpu_linear.use_onednn_linears(model) == 2
    assert cpu_linear.use_onednn_linears(model) == 0  # already switched
    assert list(model.parameters()) == params
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    calls = _counting(monkeypatch)
    torch.testing.assert_close(model(torch.ones(5, 4)), plain)
    assert calls == [(5, 4), (5, 8)]


def test_packed_weights_give_f_linears_values_at_any_row_count() -> None:
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    packed = cpu_linear.pack(w)
    for rows in (1, 3, cpu_linear.PACK_ROWS, 17, 300):
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(cpu_linear.packed_linear(x, packed, b), nn.functional.linear(x, w, b))
