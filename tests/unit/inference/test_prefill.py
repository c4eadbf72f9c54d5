"""Which prompts the engine prefills together, which wait for another's KV, and which attend through the
attention kernel (services.inference.prefill)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.cache_utils import DynamicCache

from services.inference import prefill
from services.inference.kv import layer_kv
from services.inference.llama_decode import llama_decoder
from services.inference.prefill import (
    PAD_SLACK,
    PROMPT_ATTENTION,
    SHARED_MIN,
    Prompt,
    _rows_padding,
    defer_shared,
    group_prefills,
    prefill_together,
    use_prompt_attention,
)
from spade import attention

from .test_llama_decode import tiny_llama  # heads of 16 (the kernel's multiple) in groups of 2, on SDPA


def _prompt(length: int, new: int, first: int = 0) -> Prompt:
    return Prompt(list(range(first, first + length)), length - new, None)


def test_short_prompts_of_similar_length_share_a_pass_in_admission_order() -> None:
    prompts = [_prompt(500, 40), _prompt(300, 30, 1000), _prompt(400, 36, 2000)]
    assert group_prefills(prompts, 1024) == [[0, 1, 2]]


def test_a_group_never_computes_more_than_its_budget_or_its_padding_slack() -> None:
    # 9 prompts of 120 new tokens: 8 fit in 1024 computed tokens, the ninth starts a group.
    groups = group_prefills([_prompt(200, 120, 1000 * i) for i in range(9)], 1024)
    assert sorted(len(g) for g in groups) == [1, 8]
    # 10 new tokens beside 100: 2 x 100 computed for 110 needed passes the slack, so they part.
    assert PAD_SLACK * 110 < 2 * 100
    assert group_prefills([_prompt(300, 10), _prompt(300, 100, 1000)], 1024) == [[0], [1]]


def test_a_prompt_shorter_than_the_groups_width_is_not_padded_into_it() -> None:
    # The second prompt is 50 tokens in all: beside a 60-token new part it would need padded queries.
    assert group_prefills([_prompt(400, 60), _prompt(50, 50, 1000)], 1024) == [[0], [1]]


def test_long_prompts_go_alone_and_zero_turns_grouping_off() -> None:
    prompts = [_prompt(900, 600), _prompt(700, 20, 1000), _prompt(800, 24, 2000)]
    assert group_prefills(prompts, 1024) == [[0], [1, 2]]
    assert group_prefills(prompts, 0) == [[0], [1], [2]]


def test_a_prompt_sharing_an_uncached_prefix_with_an_earlier_one_waits_for_its_kv() -> None:
    system = list(range(100))
    first = Prompt([*system, 1, 2, 3], 0, None)
    same_play = Prompt([*system, 1, 2, 3], 0, None)  # another play of the same first turn
    other = Prompt([*system, 7, 8], 0, None)  # shares the 100-token system prompt
    unrelated = Prompt(list(range(500, 600)), 0, None)
    assert defer_shared([first, same_play, other, unrelated]) == ([0, 3], [1, 2])


def test_a_prefix_the_cache_already_holds_does_not_make_a_prompt_wait() -> None:
    system = list(range(100))
    # Both reuse the system prompt from the cache and differ right after it.
    a = Prompt([*system, *range(1000, 1040)], 100, None)
    b = Prompt([*system, *range(2000, 2040)], 100, None)
    assert defer_shared([a, b]) == ([0, 1], [])
    # Sharing fewer than SHARED_MIN more tokens is not worth a wait either.
    c = Prompt([*system, *range(1000, 1000 + SHARED_MIN - 1), 5, *range(40)], 100, None)
    assert defer_shared([a, c]) == ([0, 1], [])


# -- the prompts' attention kernel ---------------------------------------------------------------------------

needs_attention_kernel = pytest.mark.skipif(
    attention.kernel() is None, reason=f"the attention kernel is unavailable: {attention.unavailable_reason()}"
)


def _count_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Each kernel call's (queries, keys)."""
    calls: list[tuple[int, int]] = []
    real = attention.causal_attention

    def counted(*args: Any) -> torch.Tensor:
        calls.append((args[0].shape[1], args[1].shape[1]))
        return real(*args)

    monkeypatch.setattr(attention, "causal_attention", counted)
    return calls


Twins = tuple[LlamaForCausalLM, LlamaForCausalLM, list[tuple[int, int]]]


@pytest.fixture
def twins(monkeypatch: pytest.MonkeyPatch) -> Twins:
    """The same tiny Llama twice, on SDPA and on the prompts' attention, and the kernel's calls (queries, keys)."""
    reference, model = tiny_llama(), tiny_llama()
    assert use_prompt_attention(model)
    return reference, model, _count_kernel_calls(monkeypatch)


@needs_attention_kernel
@pytest.mark.model
def test_a_prompt_alone_after_its_cached_prefix_attends_through_the_kernel_with_sdpas_logits(twins: Twins) -> None:
    reference, model, calls = twins
    assert model.config._attn_implementation == PROMPT_ATTENTION
    assert llama_decoder(model) is not None  # the lean decode step still serves it
    ids = torch.randint(1, 128, (1, 90), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        for served in (reference, model):
            cache = DynamicCache(config=served.config)
            head = served(input_ids=ids[:, :60], cache=cache, use_cache=True).logits
            tail = served(input_ids=ids[:, 60:], cache=cache, use_cache=True).logits
            if served is reference:
                expected = (head, tail)
    # the whole prompt causally, then 30 new tokens after 60 cached: every layer through the kernel
    assert calls == [(60, 60), (60, 60), (30, 90), (30, 90)]
    torch.testing.assert_close(head, expected[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(tail, expected[1], atol=1e-5, rtol=0)


@needs_attention_kernel
@pytest.mark.model
def test_prompts_prefilled_together_attend_through_the_kernel_each_after_its_padding(twins: Twins) -> None:
    reference, model, calls = twins
    generator = torch.Generator().manual_seed(5)
    ids = [torch.randint(1, 128, (n,), generator=generator).tolist() for n in (30, 24, 10)]

    def forward(served: LlamaForCausalLM) -> Any:
        return lambda **kwargs: served(use_cache=True, **kwargs).logits

    def prompts(served: LlamaForCausalLM) -> list[Prompt]:
        """10 new tokens each, after cached prefixes of 20, 14 and 0: rows left-padded by 0, 6 and 20."""
        out = []
        for tokens in ids:
            if len(tokens) == 10:
                out.append(Prompt(tokens, 0, None))
                continue
            cache = DynamicCache(config=served.config)
            served(input_ids=torch.tensor([tokens[:-10]]), cache=cache, use_cache=True)
            out.append(Prompt(tokens, len(tokens) - 10, [layer_kv(layer) for layer in cache.layers]))
        return out

    with torch.inference_mode():
        cached = prompts(reference)  # the same prefixes for both (the kernel's differ by float rounding)
        ours = prefill_together(forward(model), model.config, cached)
        theirs = prefill_together(forward(reference), reference.config, cached)
        alone = [prefill_together(forward(reference), reference.config, [p])[0] for p in cached]
    layers = model.config.num_hidden_layers
    assert calls == [(10, 30), (10, 24), (10, 10)] * layers  # every row of every layer, on its keys after its padding
    for (kv_a, a), (kv_b, b), (_, c) in zip(ours, theirs, alone, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)  # SDPA's logits, up to float rounding
        torch.testing.assert_close(a, c, atol=1e-5, rtol=0)  # and the prompt's own, prefilled alone
        for (k_a, v_a), (k_b, v_b) in zip(kv_a, kv_b, strict=True):
            torch.testing.assert_close(k_a, k_b, atol=1e-5, rtol=0)
            torch.testing.assert_close(v_a, v_b, atol=1e-5, rtol=0)


@needs_attention_kernel
@pytest.mark.model
def test_a_decode_step_of_several_padded_rows_through_transformers_forward_keeps_sdpa(
    twins: Twins, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference, model, calls = twins
    masks: list[torch.Tensor] = []  # what SDPA was given in its place
    sdpa = prefill.sdpa_attention_forward

    def recorded(*args: Any, **kwargs: Any) -> Any:
        masks.append(args[4])
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(prefill, "sdpa_attention_forward", recorded)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # the first row left-padded by 2
    ids = torch.randint(1, 128, (2, 5), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        for served in (reference, model):
            cache = DynamicCache(config=served.config)
            served(input_ids=ids[:, :4], attention_mask=mask[:, :4], cache=cache, use_cache=True)
            step = served(input_ids=ids[:, 4:], attention_mask=mask, cache=cache, use_cache=True).logits
            if served is reference:
                expected = step
    # The prompts' pass pads the first row's queries (SDPA's), and the one-token step of two rows, whose mask
    # is causal after each row's padding, keeps SDPA too: transformers' logits bit for bit.
    assert calls == []
    assert torch.equal(step, expected)
    assert _rows_padding(masks[-1], 2, 1, 5) == [2, 0]  # the step's mask, which the kernel would have served


def test_only_sdpas_causal_masks_after_left_padding_are_taken_for_the_kernel() -> None:
    seen = torch.ones(3, 5, dtype=torch.bool).tril(2)
    assert _rows_padding(None, 1, 4, 4) == [0] and _rows_padding(None, 2, 1, 9) == [0, 0]
    assert _rows_padding(None, 1, 3, 5) is None  # SDPA's is_causal would align the queries to the first keys
    assert _rows_padding(seen[None, None], 1, 3, 5) == [0]
    padded = seen.clone()
    padded[:, :2] = False  # a row left-padded by 2 (all of its cached prefix)
    assert _rows_padding(padded[None, None], 1, 3, 5) == [2]
    assert _rows_padding(torch.stack([seen, padded])[:, None], 2, 3, 5) == [0, 2]
    too_far = seen.clone()
    too_far[:, :3] = False  # the first query's own key padded: a fully masked query
    assert _rows_padding(too_far[None, None], 1, 3, 5) is None
    holed = seen.clone()
    holed[:, 1] = False  # a hole after a real key
    assert _rows_padding(holed[None, None], 1, 3, 5) is None
    assert _rows_padding(seen[None, None].float(), 1, 3, 5) is None  # an additive mask
    one = seen[None, None]
    assert _rows_padding(one, 1, 3, 5) == [0]
    assert _rows_padding(one, 2, 3, 5) is None  # the same mask object broadcast over two rows: not its verdict
    assert _rows_padding(torch.ones(1, 1, 3, 5, dtype=torch.bool), 1, 3, 5) is None  # not causal


@pytest.mark.model
def test_fp32_weights_keep_sdpa_and_rounded_weights_take_the_kernel() -> None:
    from services.inference.engine import BatchEngine

    engine = BatchEngine.__new__(BatchEngine)  # only _serve's choice: no scheduler, no checkpoint
    engine.lean_decode = True
    engine.weights = "float32"
    fp32, _ = engine._serve(tiny_llama())
    assert fp32.config._attn_implementation == "sdpa"
    engine.weights = "bf16"
    bf16, decoder = engine._serve(tiny_llama())
    expected = PROMPT_ATTENTION if attention.kernel() is not None else "sdpa"
    assert bf16.config._attn_implementation == expected and decoder is not None
