"""Prompt-lookup drafts: what a sequence's own tokens propose (tests/integration/inference/test_speculative.py
verifies them on the model)."""

from __future__ import annotations

from services.inference.speculative import PromptLookup


def test_the_longest_matching_ngram_drafts_what_followed_it_last() -> None:
    # "2 3" followed by 9 at the start, by 4 later; the 3-gram "1 2 3" only at the start.
    lookup = PromptLookup([1, 2, 3, 9, 9, 7, 2, 3, 4, 5, 1, 2, 3])
    assert lookup.draft(2) == [9, 9]  # the 3-gram's continuation wins over the later 2-gram's
    lookup = PromptLookup([2, 3, 9, 9, 7, 2, 3, 4, 5, 8, 2, 3])
    assert lookup.draft(3) == [4, 5, 8]  # of two occurrences, the most recent


def test_a_draft_is_cut_to_k_and_to_what_exists() -> None:
    lookup = PromptLookup([4, 5, 6, 4])
    assert lookup.draft(1) == [5]
    assert lookup.draft(10) == [5, 6, 4]
    assert lookup.draft(0) == []
    assert PromptLookup([1, 2, 3]).draft(4) == []  # nothing repeats
    assert PromptLookup([]).draft(4) == []


def test_extending_indexes_the_new_tokens_and_copies_are_independent() -> None:
    lookup = PromptLookup([7, 8])
    twin = lookup.copy()
    lookup.extend([9, 7])
    assert lookup.draft(3) == [8, 9, 7]
    assert twin.draft(3) == []
    twin.extend([1, 7])
    assert twin.draft(2) == [8, 1]
    assert lookup.tokens == [7, 8, 9, 7] and twin.tokens == [7, 8, 1, 7]
