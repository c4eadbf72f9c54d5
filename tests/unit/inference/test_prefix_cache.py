"""The prefix cache: longest-prefix reuse, LRU eviction by token budget, never a full match."""

from __future__ import annotations

import torch

from services.inference.prefix_cache import PrefixCache, common_prefix_length


def _kv(n: int, fill: float = 1.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    k = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1) + fill
    return [(k, -k), (2 * k, -2 * k)]


def test_common_prefix_length() -> None:
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([1, 2], [1, 2]) == 2


def test_the_longest_prefix_is_reused_as_sliced_kv() -> None:
    cache = PrefixCache(max_tokens=100, min_match=2)
    cache.insert([1, 2, 3, 4, 5], _kv(5))
    cache.insert([1, 2, 9, 9], _kv(4, fill=10.0))
    reused, kv = cache.lookup([1, 2, 3, 4, 7, 8])
    assert reused == 4 and kv is not None
    assert kv[0][0].shape[2] == 4 and kv[0][0].flatten().tolist() == [1.0, 2.0, 3.0, 4.0]
    assert kv[1][1].flatten().tolist() == [-2.0, -4.0, -6.0, -8.0]


def test_at_least_one_prompt_token_is_left_to_compute() -> None:
    cache = PrefixCache(max_tokens=100, min_match=2)
    cache.insert([1, 2, 3, 4], _kv(4))
    reused, _ = cache.lookup([1, 2, 3, 4])
    assert reused == 3


def test_short_matches_and_misses_are_not_reused() -> None:
    cache = PrefixCache(max_tokens=100, min_match=3)
    cache.insert([1, 2, 3, 4], _kv(4))
    assert cache.lookup([1, 2, 9, 9]) == (0, None)
    assert cache.lookup([7, 1, 2, 3]) == (0, None)


def test_budget_evicts_least_recently_used_and_supersedes_prefixes() -> None:
    cache = PrefixCache(max_tokens=10, min_match=1)
    cache.insert([1, 2, 3], _kv(3))
    cache.insert([1, 2, 3, 4, 5], _kv(5))  # supersedes [1, 2, 3]
    assert len(cache) == 1 and cache.tokens == 5
    cache.insert([7, 8, 9, 10], _kv(4))
    cache.lookup([1, 2, 3, 4, 5, 6])  # touch: [7..10] is now the least recently used
    cache.insert([5, 5, 5], _kv(3))
    assert cache.tokens <= 10
    assert cache.lookup([7, 8, 9, 10, 11]) == (0, None)
    assert cache.lookup([1, 2, 3, 4, 5, 6])[0] == 5


def test_clear_and_disabled() -> None:
    cache = PrefixCache(max_tokens=10, min_match=1)
    cache.insert([1, 2, 3], _kv(3))
    cache.clear()
    assert len(cache) == 0 and cache.lookup([1, 2, 3, 4]) == (0, None)
    off = PrefixCache(max_tokens=0)
    off.insert([1, 2, 3], _kv(3))
    assert len(off) == 0
