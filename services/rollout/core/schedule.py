"""The env window schedule: which slot of which active env is due to be played.

An env's window is ``k`` slots, fixed when the rollout first plays the env (WAVE2 §3): slot ``i``
belongs to weight version ``window_start + i``, where ``window_start`` is the rollout's current
version at that first play (recorded in the memory, first writer wins). Slot 0 plays both arms on
the same G seeds (regret); slots ``1..k-1`` play fresh seeds without the hint (windowed win rate).

A slot is due once the latest published version has reached it. Slots are played in order, each
exactly once: a slot whose version has already passed is played *late* under its own index, never
skipped silently; only an env whose plays keep failing has a slot skipped, and then the reason is
recorded. After slot ``k-1`` the window closes and the env retires.

>>> env = ActiveEnv("e", "game", "Optimization", "d", window=2, design_version=3)
>>> due_slot(env, latest=None), due_slot(env, latest=7)
(0, 0)
>>> env = env.fixed(start=4, window=2).done(0)
>>> due_slot(env, latest=4), due_slot(env, latest=5), due_slot(env, latest=9), is_late(env, 1, 9)
(None, 1, 1, True)
>>> env.done(1).closed
True
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass


class EnvStatus(enum.StrEnum):
    """Lifecycle of an env in the rollout's active set."""

    ACTIVE = "active"
    """Inside its window: slots are due as versions arrive."""
    CLOSED = "closed"
    """Every slot is played (or skipped with a reason); the memory has not yet been told."""
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
        window: ``k``: how many slots (weight versions) it is played at.
        design_version: The weight version that designed it (``EnvReady.weight_version``); the
            window never starts before it.
        spec_id: The run spec it was announced under.
        window_start: The version of slot 0, fixed at the first play (None before).
        slots_done: Slots ``0..slots_done-1`` are durable (played, or skipped with a reason).
        status: Lifecycle state.
    """

    env_id: str
    setting: str
    skill: str
    designer_sample_id: str
    window: int
    design_version: int = 0
    spec_id: str = ""
    window_start: int | None = None
    slots_done: int = 0
    status: EnvStatus = EnvStatus.ACTIVE

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"an env's window must hold at least one slot, got window={self.window}")

    @property
    def closed(self) -> bool:
        """Whether every slot of the window is durable."""
        return self.window_start is not None and self.slots_done >= self.window

    def slot_version(self, slot: int) -> int:
        """The weight version slot ``slot`` belongs to.

        Raises:
            ValueError: The window is not fixed yet, or ``slot`` lies outside it.
        """
        if self.window_start is None:
            raise ValueError(f"env {self.env_id}'s window is not fixed yet: it is fixed at its first play")
        if not 0 <= slot < self.window:
            raise ValueError(f"slot {slot} is outside env {self.env_id}'s window of {self.window} slots")
        return self.window_start + slot

    def fixed(self, start: int, window: int) -> ActiveEnv:
        """This env with its window fixed at ``start`` for ``window`` slots (the memory's answer)."""
        return dataclasses.replace(self, window_start=start, window=window)

    def done(self, slot: int) -> ActiveEnv:
        """This env after slot ``slot`` became durable."""
        return dataclasses.replace(self, slots_done=max(self.slots_done, slot + 1))


def due_slot(env: ActiveEnv, latest: int | None) -> int | None:
    """The slot of ``env`` to play now, given the latest published weight version.

    Slot 0 (the first plays) is always due; slot ``i > 0`` once ``latest`` reaches its version,
    however far past it (a late slot is played under its own index). None when nothing is due.
    """
    if env.status is not EnvStatus.ACTIVE or env.closed:
        return None
    if env.window_start is None or env.slots_done == 0:
        return 0
    slot = env.slots_done
    if latest is None or latest < env.slot_version(slot):
        return None
    return slot


def is_late(env: ActiveEnv, slot: int, latest: int | None) -> bool:
    """Whether ``slot`` is played after a newer version than its own was published."""
    return latest is not None and env.window_start is not None and latest > env.slot_version(slot)


def current_version(design_version: int, latest: int | None) -> int:
    """The rollout's current version for an env's first play: the latest seen, never before its design.

    >>> current_version(3, None), current_version(3, 5), current_version(3, 2)
    (3, 5, 3)
    """
    return design_version if latest is None else max(design_version, latest)
