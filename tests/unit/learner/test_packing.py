"""Sequence packing: one row per micro-batch, no padding, and each sequence still on its own.

Every figure of a packed forward (logprobs, loss, gradients) must equal the same sequences run one
per forward, for every attention path: the per-sequence calls (``segment_attention``) of the attention
kernel and of SDPA, and ``transformers``' own block-diagonal mask built from restarting position ids
(the fallback).
"""

from __future__ import annotations

import random
import threading
from dataclasses import replace
from typing import Any

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from services.learner import logprobs as lp
from services.learner.core.batching import (
    BatchError,
    Role,
    TrainSample,
    deal_by_prefixes,
    prefix_groups,
    shareable_prefix,
)
from services.learner.core.collate import collate, pack
from services.learner.core.losses import GrpoLossConfig, LossInputs, build_loss
from services.learner.trainer import OptimConfig, Trainer, token_logprobs
from spade import attention

from .conftest import VOCAB, grouped_batch, random_batch, tiny_llama

PATHS = ["kernel", "segments", "transformers-mask"]


@pytest.fixture(params=PATHS)
def attention_path(request, monkeypatch):
    """Run the test through each packed-attention path: the attention kernel's per-sequence calls, SDPA's
    (the kernel turned off), and transformers' mask (the fallback, forced for Llama)."""
    if request.param == "kernel" and attention.kernel() is None:
        pytest.skip(f"the attention kernel is unavailable: {attention.unavailable_reason()}")
    if request.param != "kernel":
        monkeypatch.setattr(attention, "applies", lambda *tensors: False)
    if request.param == "transformers-mask":
        monkeypatch.setattr(lp, "segment_attention_applies", lambda model: False)
    return request.param


def _llama(seed: int, attn: str = "sdpa"):
    model = tiny_llama(seed=seed)
    model.set_attn_implementation(attn)
    return model


def _one_per_forward(model, samples, temperature=1.0, fused=False):
    return [token_logprobs(model, collate([s]), temperature, fused=fused)[0] for s in samples]


def test_pack_lays_sequences_back_to_back_with_restarting_positions():
    samples = random_batch(n=3, seed=2)
    batch = pack(samples)
    lengths = [len(s.token_ids) for s in samples]
    assert batch.input_ids.shape == (1, sum(lengths)) and batch.attention_mask is None
    assert batch.cu_seqlens is not None and batch.cu_seqlens.tolist() == [0, lengths[0], sum(lengths[:2]), sum(lengths)]
    assert batch.position_ids is not None
    assert batch.position_ids[0].tolist() == [p for n in lengths for p in range(n)]
    assert batch.max_length == max(lengths)
    # Per-token advantages; the boundary target (the next sequence's first token) never trains.
    for s, adv, mask in zip(samples, batch.split(batch.advantages), batch.split(batch.loss_mask), strict=True):
        assert torch.all(adv == s.advantage)
        assert mask.tolist() == [float(m) for m in s.loss_mask[1:]]
    assert float(batch.loss_mask.sum()) == sum(s.trained_tokens for s in samples)
    with pytest.raises(BatchError, match="empty"):
        pack([])


@pytest.mark.model
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_packed_logprobs_equal_one_sequence_per_forward(attention_path, attn, temperature):
    model = _llama(seed=0, attn=attn)
    samples = random_batch(n=6, seed=7, min_len=3, max_len=40)
    batch = pack(samples)
    with torch.no_grad():
        packed = batch.split(token_logprobs(model, batch, temperature, fused=False))
        alone = _one_per_forward(model, samples, temperature)
    assert [p.shape for p in packed] == [a.shape for a in alone]
    for p, a in zip(packed, alone, strict=True):
        assert torch.allclose(p, a, atol=1e-5, rtol=0), float((p - a).abs().max())
    assert model.config._attn_implementation == attn  # the packed path left the model as it was


@pytest.mark.model
def test_no_token_attends_across_a_sequence_boundary(attention_path):
    model = _llama(seed=1)
    first, second = random_batch(n=2, seed=3, min_len=12, max_len=16)
    changed = replace(first, token_ids=tuple((t % (VOCAB - 1)) + 1 for t in reversed(first.token_ids)))
    with torch.no_grad():
        a = pack([first, second])
        b = pack([changed, second])
        before = a.split(token_logprobs(model, a, fused=False))
        after = b.split(token_logprobs(model, b, fused=False))
    assert not torch.allclose(before[0], after[0], atol=1e-3)  # the change is visible where it was made ...
    assert torch.allclose(before[1], after[1], atol=1e-6)  # ... and nowhere else


def _loss_and_grads(model, ref, batches, config, normalizer, temperature):
    model.zero_grad(set_to_none=True)
    loss = build_loss(config)
    total = torch.zeros(())
    for batch in batches:
        logp = token_logprobs(model, batch, temperature)
        ref_lp = token_logprobs(ref, batch, temperature).detach() if ref is not None else None
        # An "old" policy a little off the current one (by token, whatever the layout), so the
        # clipped ratio is exercised too.
        old = (logp.detach() + 0.3 * torch.sin(batch.targets.float())) * batch.loss_mask
        out = loss(LossInputs(logp, old, batch.rollout_logprobs, batch.advantages, batch.loss_mask, ref_lp), normalizer)
        out.loss.backward()
        total = total + out.loss.detach()
    return float(total), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.model
@pytest.mark.parametrize("config", [GrpoLossConfig(kl_coef=0.05), GrpoLossConfig(eps_low=0.1, eps_high=0.1)])
def test_packed_loss_and_gradients_equal_one_sequence_per_forward(attention_path, config):
    samples = random_batch(n=7, seed=12, min_len=4, max_len=30)
    normalizer = float(sum(s.trained_tokens for s in samples))
    model, ref = _llama(seed=2), _llama(seed=5)
    packed_loss, packed_grads = _loss_and_grads(model, ref, [pack(samples)], config, normalizer, 0.7)
    alone_loss, alone_grads = _loss_and_grads(model, ref, [collate([s]) for s in samples], config, normalizer, 0.7)
    assert abs(packed_loss) > 1e-3  # a vacuous match on zero would prove nothing
    assert packed_loss == pytest.approx(alone_loss, abs=1e-6)
    assert packed_grads.keys() == alone_grads.keys() == {n for n, _ in model.named_parameters()}
    for name, g in packed_grads.items():
        assert torch.allclose(g, alone_grads[name], atol=1e-6, rtol=1e-4), name


@pytest.mark.model
def test_chunked_head_on_a_packed_row_equals_full_logits():
    batch = pack(random_batch(n=4, seed=8))
    results = []
    for kwargs in ({"fused": False}, {"logits_budget": VOCAB * 3}):
        model = _llama(seed=4)
        logp = token_logprobs(model, batch, 0.6, **kwargs)
        (logp * batch.loss_mask).sum().backward()
        results.append((logp.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (full, g_full), (chunked, g_chunked) = results
    assert torch.allclose(full * batch.loss_mask, chunked, atol=1e-6)
    for a, b in zip(g_full, g_chunked, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def _same_update(samples, *configs: OptimConfig):
    """One training step per config, each on a fresh copy of the same model: asserts the loss, gradient
    norm and AdamW first moments agree, and returns each step's metrics."""
    runs = []
    for optim in configs:
        model = tiny_llama(seed=1)
        trainer = Trainer(model, build_loss(GrpoLossConfig()), optim)
        m = trainer.train_step(samples)
        runs.append((m, [trainer.optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]))
    (first, moments), *rest = runs
    for m, other in rest:
        assert m.loss == pytest.approx(first.loss, abs=1e-6)
        assert m.grad_norm == pytest.approx(first.grad_norm, rel=1e-5)
        for a, b in zip(moments, other, strict=True):
            assert torch.allclose(a, b, atol=1e-8, rtol=1e-4)
    return [m for m, _ in runs]


@pytest.mark.model
def test_packed_and_padded_training_steps_give_the_same_update():
    packed, padded = _same_update(random_batch(n=7, seed=4), OptimConfig(lr=1e-3), OptimConfig(lr=1e-3, packed=False))
    assert packed.micro_batches == padded.micro_batches == 1


@pytest.mark.model
def test_the_attention_choice_follows_the_model():
    llama = tiny_llama()
    assert lp.segment_attention_applies(llama)
    llama.set_attn_implementation("eager")
    assert lp.segment_attention_applies(llama)
    window = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=0,
        )
    )
    assert not lp.segment_attention_applies(window)  # windows span sequences: transformers' mask handles them


@pytest.mark.model
def test_a_sliding_window_model_packs_through_transformers_masks():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=0,
        )
    )
    model.set_attn_implementation("sdpa")
    samples = random_batch(n=4, seed=9, min_len=8, max_len=20)
    batch = pack(samples)
    with torch.no_grad():
        packed = batch.split(token_logprobs(model, batch, fused=False))
        alone = _one_per_forward(model, samples)
    for p, a in zip(packed, alone, strict=True):
        assert torch.allclose(p, a, atol=1e-5, rtol=0)


def test_segment_attention_refuses_a_call_without_boundaries():
    q = torch.zeros(1, 4, 3, 8)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        lp.segment_attention(torch.nn.Module(), q, q, q, None)


def test_segment_attention_runs_a_shared_row_in_a_thread_that_never_ran_token_logprobs():
    """As a forward recomputed on another thread (activation checkpointing in a GPU's backward) does."""
    q = torch.randn(1, 4, 7, 8)
    bounds = torch.tensor([0, 3, 5, 7], dtype=torch.int32)  # a shared segment, then two members of it
    out: list[Any] = []
    thread = threading.Thread(
        target=lambda: out.append(
            lp.segment_attention(torch.nn.Module(), q, q, q, None, cu_seq_lens_q=bounds, spade_parents=(-1, 0, 0))
        )
    )
    thread.start()
    thread.join()
    assert out and out[0][0].shape == (1, 7, 4, 8)  # it ran (no error from an unset per-thread count)


@pytest.mark.model
def test_a_failing_forward_restores_the_attention_implementation():
    model = _llama(seed=0)
    bad = pack([TrainSample("x", Role.AGENT, (1, VOCAB + 5, 2), (0.0, 0.0, 0.0), (False, True, True), 0)])
    with pytest.raises((IndexError, RuntimeError)):
        token_logprobs(model, bad)
    assert model.config._attn_implementation == "sdpa"


# -- shared prefixes ----------------------------------------------------------------------------------


def _limited_batch(seed: int = 0) -> list[TrainSample]:
    """Three plays of one 24-token prompt whose shared span only a trained token limits (member 1
    trains token 20), member 2 constrained, and two unrelated samples."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1, VOCAB) for _ in range(24)]
    out = []
    for i in range(3):
        tail = [1 + i] + [rng.randrange(1, VOCAB) for _ in range(rng.randint(4, 10))]
        mask = [False] * len(prompt) + [True] * len(tail)
        if i == 1:
            mask[20] = True
        lps = tuple(rng.uniform(-5.0, -3.0) if m else 0.0 for m in mask)
        ids = tuple(prompt + tail)
        out.append(TrainSample(f"l{i}", Role.AGENT, ids, lps, tuple(mask), 0, rng.uniform(-1.5, 1.5), i == 2))
    return out + random_batch(n=2, seed=seed + 3)


def test_a_trained_token_inside_the_prompt_ends_the_shared_span_before_it():
    samples = _limited_batch()
    groups = prefix_groups(samples)
    assert (19, [0, 1, 2]) in [(n, sorted(m)) for n, m in groups]  # 23 were common; token 20 trains in one
    batch = pack(samples, share_prefixes=True)
    plain = pack(samples)
    trained = plain.split(plain.loss_mask)
    for field in ("targets", "loss_mask", "rollout_logprobs", "constrained"):
        pairs = zip(plain.split(getattr(plain, field)), batch.split(getattr(batch, field)), trained, strict=True)
        for a, b, where in pairs:  # the shared span trains nothing: its flags are the first member's
            assert torch.equal(a[where > 0], b[where > 0]), field


def test_a_lone_sample_that_shares_only_a_header_stays_out_of_a_group():
    """Grouping saves the most tokens in all: a sample sharing a 10-token header with a group that shares
    30 tokens is left alone rather than bring the group down to the header."""
    header, body = list(range(1, 11)), list(range(40, 60))

    def play(ids: list[int]) -> TrainSample:
        return TrainSample("p", Role.AGENT, tuple(ids), (0.0,) * len(ids), (False,) * 31 + (True,) * (len(ids) - 31), 0)

    lone = play([*header, 1, *range(70, 100)])
    group = [play([*header, 2, *body, i, 5, 6]) for i in (3, 4, 5)]
    assert prefix_groups([lone, *group]) == [(0, [0]), (30, [1, 2, 3])]


def test_a_shared_prefix_stops_before_the_first_trained_token_and_the_first_difference():
    samples = grouped_batch()
    groups = prefix_groups(samples)
    assert sorted(i for _, members in groups for i in members) == list(range(len(samples)))
    for shared, members in groups:
        assert shared == shareable_prefix([samples[i] for i in members])
        for i in members:  # every shared token and the one after it are equal and untrained in every member
            assert samples[i].token_ids[: shared + 1] == samples[members[0]].token_ids[: shared + 1]
            assert not any(samples[i].loss_mask[: shared + 1])
    grouped = {i: shared for shared, members in groups for i in members}
    assert grouped[4] <= 19 and grouped[0] > 0  # member 4's trained token 20 bounds what it shares
    batch = pack(samples, share_prefixes=True)
    assert batch.input_ids.shape[1] == sum(len(s.token_ids) for s in samples) - sum((len(m) - 1) * n for n, m in groups)
    assert batch.input_ids.shape[1] < pack(samples).input_ids.shape[1]
    plain = pack(samples)  # each sample's tokens, targets, masks and logprobs, as plain packing has them
    for field in ("targets", "loss_mask", "rollout_logprobs"):
        for a, b in zip(plain.split(getattr(plain, field)), batch.split(getattr(batch, field)), strict=True):
            assert torch.equal(a, b), field
    assert float(batch.loss_mask.sum()) == float(plain.loss_mask.sum())


def test_samples_with_nothing_in_common_pack_as_before():
    samples = random_batch(n=4, seed=2)
    shared, plain = pack(samples, share_prefixes=True), pack(samples)
    assert shared.parents is None and torch.equal(shared.input_ids, plain.input_ids)


@pytest.mark.model
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("fused", [True, False])
def test_shared_prefixes_give_each_sample_the_logprobs_it_gets_alone(attn, fused):
    model = _llama(seed=3, attn=attn)
    samples = grouped_batch(seed=5)
    batch = pack(samples, share_prefixes=True)
    assert batch.parents is not None and max(batch.parents) >= 0
    with torch.no_grad():
        shared = batch.split(token_logprobs(model, batch, 0.7, fused=fused))
        alone = [token_logprobs(model, collate([s]), 0.7, fused=fused)[0] for s in samples]
    for s, a, b in zip(samples, shared, alone, strict=True):
        mask = torch.tensor(s.loss_mask[1:], dtype=torch.float32) if fused else 1.0
        assert torch.allclose(a * mask, b * mask, atol=1e-5, rtol=0), float((a - b).abs().max())


@pytest.mark.model
def test_shared_prefixes_run_under_bf16_autocast():
    """The embedded learner trains under bf16 autocast where the CPU has bf16: there the shared row's
    attention gets a float32 query and a bf16 value, and must still run and agree with whole samples."""
    from spade import training

    model = _llama(seed=3)
    samples = grouped_batch(seed=5)
    with torch.no_grad(), training.autocast(torch.device("cpu"), True):
        shared = pack(samples, share_prefixes=True)
        plain = pack(samples)
        a = shared.split(token_logprobs(model, shared))
        b = plain.split(token_logprobs(model, plain))
    for x, y, where in zip(a, b, plain.split(plain.loss_mask), strict=True):
        assert torch.allclose(x[where > 0], y[where > 0], atol=0.1), float((x - y).abs().max())


@pytest.mark.model
@pytest.mark.parametrize("batch", ["grouped", "limited"])
def test_shared_prefixes_give_the_same_training_step(batch):
    """Loss, gradient norm and AdamW's first moments of one step equal with and without sharing: the shared
    tokens' gradients gather every member's (each member's attention reads the shared keys and values).
    ``limited``: the shared span ends where a member trains, and one member is constrained."""
    samples = grouped_batch(seed=7) if batch == "grouped" else _limited_batch(seed=7)
    shared, plain = _same_update(samples, OptimConfig(lr=1e-3), OptimConfig(lr=1e-3, share_prefixes=False))
    assert abs(plain.loss) > 1e-4 and shared.tokens == plain.tokens == plain.row_tokens
    assert shared.row_tokens < shared.tokens  # the shared prompts were computed once


@pytest.mark.model
def test_a_model_without_segment_attention_never_gets_a_shared_row():
    model = tiny_llama(seed=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lp, "segment_attention_applies", lambda model: False)
        trainer = Trainer(model, build_loss(GrpoLossConfig()), OptimConfig(lr=1e-3))
        assert not trainer.share_prefixes  # transformers' masks read restarting positions: they cannot share
        with pytest.raises(ValueError, match="segment attention"):
            token_logprobs(model, pack(grouped_batch(), share_prefixes=True))
        assert trainer.train_step(grouped_batch()).micro_batches == 1


@pytest.mark.model
def test_a_forward_that_drops_the_parents_fails_loudly(monkeypatch):
    """A model whose forward did not hand ``spade_parents`` to its attention would attend each member from
    the wrong place: the logprobs are refused instead."""
    model = _llama(seed=0)
    kept = lp._model_inputs

    def dropping(model, batch):
        inputs, segments = kept(model, batch)
        inputs.pop(lp.SHARED_PREFIXES, None)
        return inputs, segments

    monkeypatch.setattr(lp, "_model_inputs", dropping)
    with torch.no_grad(), pytest.raises(RuntimeError, match="did not pass spade_parents"):
        token_logprobs(model, pack(grouped_batch(), share_prefixes=True))
    with torch.no_grad():  # a row without shared prefixes needs no parents
        token_logprobs(model, pack(random_batch(n=2, seed=1), share_prefixes=True))


@pytest.mark.model
def test_small_micro_batches_keep_a_group_together():
    """With a budget that forces several micro-batches but holds the group (97 tokens shared, 240 not),
    the group still shares its prompt in one of them: the step computes as many tokens as one micro-batch
    would, and makes the same update as without sharing."""
    samples = grouped_batch(seed=3)
    one = pack(samples, share_prefixes=True).input_ids.shape[1]
    budget = 110
    shared, plain = _same_update(
        samples,
        OptimConfig(lr=1e-3, micro_batch_tokens=budget),
        OptimConfig(lr=1e-3, micro_batch_tokens=budget, share_prefixes=False),
    )
    assert shared.micro_batches > 1 and shared.row_tokens == one < plain.row_tokens


@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
def test_ranks_get_whole_prefix_groups_and_loads_within_one_group(ranks):
    samples = grouped_batch(seed=3) + grouped_batch(seed=4) + grouped_batch(seed=5) + random_batch(n=5, seed=9)
    groups = [members for shared, members in prefix_groups(samples) if shared]
    dealt = deal_by_prefixes(samples, ranks, budget=4096)
    assert len(dealt) == ranks and sorted(i for d in dealt for i in d) == list(range(len(samples)))
    owner = {i: r for r, d in enumerate(dealt) for i in d}
    assert len(groups) == 3 and all(len({owner[i] for i in g}) == 1 for g in groups)
    # Each rank's tokens to compute: its groups' shared prompts once, and every member's own tokens.
    loads = [pack([samples[i] for i in d], share_prefixes=True).input_ids.shape[1] if d else 0 for d in dealt]
    largest = max(pack([samples[i] for i in g], share_prefixes=True).input_ids.shape[1] for g in groups)
    assert max(loads) - min(loads) <= largest
    assert sum(loads) == pack(samples, share_prefixes=True).input_ids.shape[1]  # no prompt computed twice
    with pytest.raises(BatchError, match="ranks must be >= 1"):
        deal_by_prefixes(samples, 0, budget=4096)
