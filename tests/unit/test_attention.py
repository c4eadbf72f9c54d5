"""The causal attention kernel (spade.attention): SDPA's results and gradients, faster.

Every figure is checked against float64 SDPA with the mask the kernel's semantics imply: query ``i`` of
``n`` sees keys ``[0, T - n + i]``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spade import attention

needs_kernel = pytest.mark.skipif(
    attention.kernel() is None, reason=f"the attention kernel is unavailable here: {attention.unavailable_reason()}"
)


def _case(
    heads: int, kv_heads: int, queries: int, keys: int, dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(heads, queries, dim, generator=generator, dtype=torch.float64),
        torch.randn(kv_heads, keys, dim, generator=generator, dtype=torch.float64),
        torch.randn(kv_heads, keys, dim, generator=generator, dtype=torch.float64),
    )


def _reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    queries, keys = query.shape[1], key.shape[1]
    seen = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
    out = nn.functional.scaled_dot_product_attention(
        query[None], key[None], value[None], attn_mask=seen, scale=scale, enable_gqa=True
    )
    return out[0]


SHAPES = [
    # heads, kv heads, queries, keys, dim: SmolLM2's grouping, a prefix before the queries, one query, a
    # group per head, groups of 4, dims of 1 to 8 registers with a remainder, blocks of keys with tails
    (9, 3, 37, 37, 64),
    (9, 3, 100, 900, 64),
    (9, 3, 1, 70, 64),
    (4, 4, 13, 20, 32),
    (8, 2, 50, 50, 128),
    (6, 3, 1, 1, 16),
    (9, 3, 130, 200, 80),
    (2, 1, 7, 129, 48),
    (12, 1, 9, 30, 32),  # 12 heads on one: a position's rows span two tiles
]


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "queries", "keys", "dim"), SHAPES)
def test_outputs_and_gradients_are_sdpas_over_the_keys_each_query_sees(
    heads: int, kv_heads: int, queries: int, keys: int, dim: int
) -> None:
    exact = _case(heads, kv_heads, queries, keys, dim, seed=queries + keys)
    ours = [x.float().requires_grad_() for x in exact]
    theirs = [x.clone().requires_grad_() for x in exact]
    scale = dim**-0.5
    out = attention.causal_attention(ours[0], ours[1], ours[2], scale)
    expected = _reference(theirs[0], theirs[1], theirs[2], scale)
    assert out.dtype == torch.float32 and out.shape == (heads, queries, dim)
    torch.testing.assert_close(out.double(), expected.detach(), atol=1e-5, rtol=0)
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out.backward(grad.float())
    expected.backward(grad)
    for mine, reference, name in zip(ours, theirs, ("query", "key", "value"), strict=True):
        assert mine.grad is not None and reference.grad is not None
        torch.testing.assert_close(mine.grad.double(), reference.grad, atol=2e-5, rtol=0, msg=name)


@needs_kernel
def test_bf16_inputs_are_widened_and_their_gradients_come_back_in_bf16() -> None:
    exact = _case(9, 3, 60, 80, 64, seed=5)
    rounded = [x.bfloat16().requires_grad_() for x in exact]
    out = attention.causal_attention(rounded[0], rounded[1], rounded[2], 0.125)
    assert out.dtype == torch.bfloat16
    # The arithmetic is fp32 on the rounded values: only the output's own rounding to bf16 separates them.
    widened = [x.detach().double() for x in rounded]
    expected = _reference(widened[0], widened[1], widened[2], 0.125)
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=2**-8)
    out.float().sum().backward()
    assert all(x.grad is not None and x.grad.dtype == torch.bfloat16 for x in rounded)


@needs_kernel
def test_a_querys_result_does_not_depend_on_the_queries_beside_it() -> None:
    """The last queries of a prompt alone (the rest cached before them) give the bits they give in the whole."""
    query, key, value = (x.float() for x in _case(9, 3, 300, 300, 64, seed=9))
    whole = attention.causal_attention(query, key, value, 0.125)
    tail = attention.causal_attention(query[:, 251:].contiguous(), key, value, 0.125)
    assert torch.equal(whole[:, 251:], tail)  # an odd split: other rows share its tiles


@needs_kernel
def test_shapes_it_cannot_attend_are_refused_with_the_reason() -> None:
    query, key, value = (x.float() for x in _case(9, 3, 5, 5, 64, seed=1))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        attention.causal_attention(query[..., :24], key[..., :24], value[..., :24], 0.2)
    with pytest.raises(RuntimeError, match="at least as many keys as queries"):
        attention.causal_attention(query, key[:, :3], value[:, :3], 0.125)
    with pytest.raises(RuntimeError, match="multiple of the key/value heads"):
        attention.causal_attention(query[:8], key, value, 0.125)
    # callers ask first, and keep SDPA: a head dim not of 16s, values of another dim (DeepSeek's MLA), more
    # queries than keys, no query heads
    assert not attention.applies(query[..., :24], key[..., :24], value[..., :24])
    assert not attention.applies(query, key, value[..., :48])
    assert not attention.applies(query, key[:, :3], value[:, :3])
    assert not attention.applies(query[:0], key, value)
    assert attention.applies(query, key, value)
    with pytest.raises(RuntimeError, match="positive multiple"):
        attention.causal_attention(query[:0], key, value, 0.125)


def test_the_switch_turns_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(attention.SWITCH, "0")
    monkeypatch.setattr(attention, "_reason", [])
    assert attention._load() is None
    assert attention.unavailable_reason() == f"turned off by {attention.SWITCH}"


@needs_kernel
@pytest.mark.parametrize("threads", [1, 4, 64])
def test_every_thread_count_gives_the_same_results(threads: int) -> None:
    """The backward sums each thread's parts of the key and value gradients: one thread, several, more than tasks."""
    query, key, value = (x.float() for x in _case(9, 3, 40, 70, 64, seed=11))
    before = torch.get_num_threads()

    def run() -> list[torch.Tensor]:
        inputs = [x.clone().requires_grad_() for x in (query, key, value)]
        out = attention.causal_attention(inputs[0], inputs[1], inputs[2], 0.125)
        out.backward(torch.ones_like(out))
        return [out.detach()] + [x.grad for x in inputs if x.grad is not None]

    try:
        torch.set_num_threads(1)
        alone = run()
        torch.set_num_threads(threads)
        spread = run()
    finally:
        torch.set_num_threads(before)
    assert len(spread) == 4
    torch.testing.assert_close(spread[0], alone[0], atol=0, rtol=0)  # a query's output is one task's
    for mine, reference in zip(spread[1:], alone[1:], strict=True):
        torch.testing.assert_close(mine, reference, atol=1e-5, rtol=1e-5)  # the parts add up in another order


@needs_kernel
def test_views_as_transformers_passes_them_and_inputs_without_gradients() -> None:
    """Queries are a transposed view ([heads, length, dim] of a [length, heads, dim] buffer); only the values train."""
    query, key, value = _case(4, 2, 12, 12, 32, seed=13)
    view = query.float().transpose(0, 1).contiguous().transpose(0, 1)
    assert not view.is_contiguous()
    trained = value.float().requires_grad_()
    out = attention.causal_attention(view, key.float(), trained, 32**-0.5)
    reference_value = value.clone().requires_grad_()
    expected = _reference(query, key, reference_value, 32**-0.5)
    torch.testing.assert_close(out.double(), expected.detach(), atol=1e-5, rtol=0)
    out.sum().backward()
    expected.sum().backward()
    assert trained.grad is not None and reference_value.grad is not None
    torch.testing.assert_close(trained.grad.double(), reference_value.grad, atol=1e-5, rtol=0)


@needs_kernel
def test_no_queries_give_an_empty_output() -> None:
    query, key, value = (x.float() for x in _case(9, 3, 0, 5, 64, seed=2))
    assert attention.causal_attention(query, key, value, 0.125).shape == (9, 0, 64)
