"""The env window schedule: which weight version of which active env is due to be played.

An env's window is ``k`` consecutive weight versions starting at its first version. At the first
version both arms are played (regret); at each later version of the window that the learner
publishes, the unhinted arm is played again on fresh seeds; once the last version of the window is
played, or a version past the window is published, the window closes and the env retires.

>>> env = ActiveEnv("e", "game", "Optimization", "d", first_version=3, window=2)
>>> due_version(env, latest=3), due_version(env, latest=None)
(3, 3)
>>> env = env.played(3); due_version(env, latest=3), due_version(env, latest=4), window_closed(env, 4)
(None, 4, False)
>>> window_closed(env.played(4), 4), window_closed(env, 5)
(True, True)
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass


class EnvStatus(enum.StrEnum):
    """Lifecycle of an env in the rollout's active set."""

    ACTIVE = "active"
    """Inside its window: plays are due as versions arrive."""
    CLOSED = "closed"
    """Window over; the memory has not yet been told (retried until it is)."""
    RETIRED = "retired"
    """Window over and recorded in the memory."""


@dataclass(frozen=True)
class ActiveEnv:
    """One env's place in the schedule (persisted by the state store).

    Attributes:
        env_id: The env.
        setting: ``game`` or ``tool``.
        skill: Its skill.
        designer_sample_id: The designer sample that wrote it.
        first_version: The weight version of its first plays (where regret is measured).
        window: ``k``: how many weight versions it stays active.
        played_through: Last version whose plays are recorded (None before the first plays).
        status: Lifecycle state.
    """

    env_id: str
    setting: str
    skill: str
    designer_sample_id: str
    first_version: int
    window: int
    played_through: int | None = None
    status: EnvStatus = EnvStatus.ACTIVE

    @property
    def last_version(self) -> int:
        """The last weight version of the window."""
        return self.first_version + self.window - 1

    def played(self, version: int) -> ActiveEnv:
        """This env after the plays of ``version`` were recorded."""
        return dataclasses.replace(self, played_through=version)


def due_version(env: ActiveEnv, latest: int | None) -> int | None:
    """The weight version ``env`` should be played at now, given the latest published one.

    Returns ``first_version`` until the first plays are recorded; then the latest version when it
    is newer than the last one played and still inside the window; else None.
    """
    if env.status is not EnvStatus.ACTIVE:
        return None
    if env.played_through is None:
        return env.first_version
    if latest is None or latest <= env.played_through or latest > env.last_version:
        return None
    return latest


def window_closed(env: ActiveEnv, latest: int | None) -> bool:
    """True when nothing more will be played: the last version is played or the window has passed."""
    if env.played_through is None:
        return False  # the first plays (regret) always happen, however late the env is delivered
    if env.played_through >= env.last_version:
        return True
    return latest is not None and latest > env.last_version
