"""Which prompts the engine prefills together, and which wait for another's KV (services.inference.prefill)."""

from __future__ import annotations

from services.inference.prefill import PAD_SLACK, SHARED_MIN, Prompt, defer_shared, group_prefills


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
