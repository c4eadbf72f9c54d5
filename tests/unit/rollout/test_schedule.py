from __future__ import annotations

from services.rollout.core.schedule import ActiveEnv, EnvStatus, due_version, window_closed


def _env(first: int = 5, window: int = 3) -> ActiveEnv:
    return ActiveEnv("e", "game", "Optimization", "d1", first_version=first, window=window)


def test_first_plays_are_due_at_the_first_version_whatever_the_latest() -> None:
    env = _env()
    assert env.last_version == 7
    for latest in (None, 5, 6, 9):
        assert due_version(env, latest) == 5
        assert not window_closed(env, latest)  # regret is always measured


def test_each_new_version_inside_the_window_is_due_once() -> None:
    env = _env().played(5)
    assert due_version(env, 5) is None
    assert due_version(env, 6) == 6
    env = env.played(6)
    assert due_version(env, 6) is None
    assert due_version(env, 7) == 7  # skipped versions are not replayed: the latest one is
    assert not window_closed(env, 7)
    env = env.played(7)
    assert window_closed(env, 7)


def test_a_version_past_the_window_closes_it_unplayed() -> None:
    env = _env().played(5)
    assert due_version(env, 8) is None
    assert window_closed(env, 8)


def test_a_window_of_one_closes_after_the_first_plays() -> None:
    env = _env(window=1)
    assert due_version(env, None) == 5
    assert window_closed(env.played(5), None)


def test_closed_envs_are_never_due() -> None:
    env = ActiveEnv("e", "game", "s", "d", 1, 4, played_through=1, status=EnvStatus.CLOSED)
    assert due_version(env, 2) is None
