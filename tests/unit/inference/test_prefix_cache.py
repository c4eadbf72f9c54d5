"""The radix prefix cache: insert, match (also part-way into an edge), split, LRU eviction of leaves."""

from __future__ import annotations

import torch

from services.inference.prefix_cache import KV, RadixPrefixCache, common_prefix_length


def _kv(ids: list[int]) -> KV:
    """Fake KV whose value at each position is the token id there (so slices can be checked)."""
    k = torch.tensor(ids, dtype=torch.float32).view(1, 1, len(ids), 1)
    return [(k, -k), (2 * k, -2 * k)]


def _tokens_of(kv: KV) -> list[int]:
    return [int(x) for x in kv[0][0].flatten().tolist()]


def test_common_prefix_length() -> None:
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([1, 2], [1, 2]) == 2


def test_a_shared_prefix_is_stored_once_and_matched_across_sequences() -> None:
    cache = RadixPrefixCache(max_tokens=100, min_match=2)
    system = [11, 12, 13, 14, 15]
    assert cache.insert([*system, 21, 22], _kv([*system, 21, 22])) == 7
    # Diverges after the shared prefix: the edge is split there, only the new suffix is added.
    assert cache.insert([*system, 31, 32, 33], _kv([*system, 31, 32, 33])) == 3
    assert cache.tokens == 10
    assert len(cache) == 3  # the shared prefix + two branches
    reused, kv = cache.match([*system, 31, 32, 33, 99])
    assert reused == 8 and kv is not None
    assert _tokens_of(kv) == [*system, 31, 32, 33]
    assert [int(x) for x in kv[1][1].flatten().tolist()] == [-2 * t for t in [*system, 31, 32, 33]]


def test_a_match_can_end_part_way_into_an_edge() -> None:
    cache = RadixPrefixCache(max_tokens=100, min_match=2)
    cache.insert([1, 2, 3, 4, 5, 6], _kv([1, 2, 3, 4, 5, 6]))
    reused, kv = cache.match([1, 2, 3, 9])
    assert reused == 3 and kv is not None and _tokens_of(kv) == [1, 2, 3]
    assert len(cache) == 1, "a match never changes the tree"


def test_at_least_one_prompt_token_is_left_to_compute() -> None:
    cache = RadixPrefixCache(max_tokens=100, min_match=2)
    cache.insert([1, 2, 3, 4], _kv([1, 2, 3, 4]))
    reused, kv = cache.match([1, 2, 3, 4])
    assert reused == 3 and kv is not None and _tokens_of(kv) == [1, 2, 3]


def test_short_matches_and_misses_are_not_reused() -> None:
    cache = RadixPrefixCache(max_tokens=100, min_match=3)
    cache.insert([1, 2, 3, 4], _kv([1, 2, 3, 4]))
    assert cache.match([1, 2, 9, 9]) == (0, None)
    assert cache.match([7, 1, 2, 3]) == (0, None)
    assert cache.match([1]) == (0, None)


def test_inserting_a_known_sequence_or_a_prefix_of_one_adds_nothing() -> None:
    cache = RadixPrefixCache(max_tokens=100, min_match=1)
    cache.insert([1, 2, 3, 4], _kv([1, 2, 3, 4]))
    assert cache.insert([1, 2, 3, 4], _kv([1, 2, 3, 4])) == 0
    assert cache.insert([1, 2], _kv([1, 2])) == 0
    assert cache.tokens == 4 and len(cache) == 1
    # Extending a cached sequence adds only the extension, as a child.
    assert cache.insert([1, 2, 3, 4, 5, 6], _kv([1, 2, 3, 4, 5, 6])) == 2
    assert cache.tokens == 6 and len(cache) == 2


def test_split_edges_own_their_kv() -> None:
    """After a split both halves hold copies, so evicting one frees its tokens for real."""
    cache = RadixPrefixCache(max_tokens=100, min_match=1)
    source = _kv([1, 2, 3, 4])
    cache.insert([1, 2, 3, 4], source)
    source[0][0].fill_(0)  # the caller reuses its buffer: the tree kept its own copy
    cache.insert([1, 2, 7], _kv([1, 2, 7]))
    _, kv = cache.match([1, 2, 3, 4, 5])
    assert kv is not None and _tokens_of(kv) == [1, 2, 3, 4]


def test_eviction_drops_least_recently_used_leaves_first() -> None:
    cache = RadixPrefixCache(max_tokens=12, min_match=1)
    shared = [1, 2, 3, 4]
    cache.insert([*shared, 10, 11], _kv([*shared, 10, 11]))  # leaf A
    cache.insert([*shared, 20, 21], _kv([*shared, 20, 21]))  # leaf B
    cache.insert([50, 51], _kv([50, 51]))  # leaf C
    assert cache.tokens == 10
    cache.match([*shared, 10, 11, 12])  # touch A: B is now the least recently used leaf
    cache.match([50, 51, 52])  # touch C
    cache.insert([60, 61, 62, 63], _kv([60, 61, 62, 63]))  # 14 tokens: evict until <= 12
    assert cache.tokens <= 12
    assert cache.match([*shared, 20, 21, 22])[0] == 4, "B's leaf went, the shared prefix stayed"
    assert cache.match([*shared, 10, 11, 12])[0] == 6
    assert cache.match([60, 61, 62, 63, 64])[0] == 4


def test_a_parent_whose_children_are_all_evicted_becomes_evictable() -> None:
    cache = RadixPrefixCache(max_tokens=8, min_match=1)
    cache.insert([1, 2, 3, 4, 5], _kv([1, 2, 3, 4, 5]))
    cache.insert([1, 2, 3, 9], _kv([1, 2, 3, 9]))  # split: [1,2,3] -> {[4,5], [9]}
    cache.insert([7, 7, 7, 7, 7, 7, 7], _kv([7] * 7))  # needs 7 of 8 tokens: the whole branch goes
    assert cache.tokens == 7
    assert cache.match([1, 2, 3, 4, 5]) == (0, None)
    assert len(cache) == 1


def test_too_long_sequences_clear_and_disabled() -> None:
    cache = RadixPrefixCache(max_tokens=4, min_match=1)
    assert cache.insert([1, 2, 3, 4, 5], _kv([1, 2, 3, 4, 5])) == 0
    cache.insert([1, 2, 3], _kv([1, 2, 3]))
    cache.clear()
    assert len(cache) == 0 and cache.tokens == 0 and cache.match([1, 2, 3, 4]) == (0, None)
    off = RadixPrefixCache(max_tokens=0)
    off.insert([1, 2, 3], _kv([1, 2, 3]))
    assert len(off) == 0 and off.match([1, 2, 3, 4]) == (0, None)


def test_many_random_sequences_always_match_their_true_longest_prefix() -> None:
    """Against a brute-force reference: the match length is the longest common prefix with any
    cached sequence (capped one short), and the KV returned is exactly those tokens'."""
    rng = torch.Generator().manual_seed(0)
    cache = RadixPrefixCache(max_tokens=10_000, min_match=1)
    seen: list[list[int]] = []
    for _ in range(200):
        length = int(torch.randint(2, 12, (1,), generator=rng))
        ids = [int(t) for t in torch.randint(0, 4, (length,), generator=rng)]
        limit = len(ids) - 1
        best = max((common_prefix_length(s, ids[:limit]) for s in seen), default=0)
        reused, kv = cache.match(ids)
        assert reused == best, (ids, seen)
        if best:
            assert kv is not None and _tokens_of(kv) == ids[:best]
        cache.insert(ids, _kv(ids))
        seen.append(ids)
    assert cache.tokens == sum(len(n.tokens) for n in cache._nodes())


def test_the_tree_keeps_kv_in_its_dtype_whatever_it_is_given() -> None:
    # The engine's decode batch may hold bf16 KV; its prefills continue from the tree's KV in the model's
    # dtype, so the tree converts what it copies (and copies only: a match hands out its own tensors).
    cache = RadixPrefixCache(max_tokens=100, min_match=1, dtype=torch.float32)
    rounded = [(k.bfloat16(), v.bfloat16()) for k, v in _kv([1, 2, 3, 4])]
    assert cache.insert([1, 2, 3, 4], rounded) == 4
    length, kv = cache.match([1, 2, 3, 4, 5])
    assert length == 4 and kv is not None
    assert all(k.dtype == v.dtype == torch.float32 for k, v in kv)
    assert _tokens_of(kv) == [1, 2, 3, 4]
    as_given = RadixPrefixCache(max_tokens=100, min_match=1)
    as_given.insert([1, 2, 3], rounded)
    _, kept = as_given.match([1, 2, 3, 9])
    assert kept is not None and kept[0][0].dtype == torch.bfloat16
