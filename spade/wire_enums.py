"""The domain's enums on the wire: ``spade.envs.types`` members to ``spade.v1`` enum numbers and back.

The protos (``proto/spade/v1/types.proto``) name each value after the Python member with the
enum's prefix: ``FinishReason.FAULT_CPU`` is ``FINISH_REASON_FAULT_CPU``. These two functions are
the only translation; no message carries these values as strings.

>>> from spade.envs.types import FinishReason, Setting
>>> number = to_wire(Setting.TOOL)
>>> from_wire(Setting, number) is Setting.TOOL
True
>>> from_wire(FinishReason, to_wire(FinishReason.FAULT_CPU))
<FinishReason.FAULT_CPU: 'fault_cpu'>
>>> from_wire(Setting, 0)
Traceback (most recent call last):
...
ValueError: the message carries no Setting (SETTING_UNSPECIFIED); set one of game, tool
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any, TypeVar, cast

from spade.envs.types import FinishReason, Outcome, Setting
from spade.v1 import types_pb2

E = TypeVar("E", bound=StrEnum)


def _prefix(cls: type[StrEnum]) -> str:
    """``FinishReason`` -> ``FINISH_REASON``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).upper()


def _pairs(cls: type[StrEnum], wire: Any) -> dict[StrEnum, int]:
    """Each member's proto number (``KeyError`` at import when the proto lacks one: the protos and
    ``spade.envs.types`` must change together)."""
    return {member: wire.Value(f"{_prefix(cls)}_{member.name}") for member in cls}


# Built once, per enum (members of two enums with the same value, FinishReason.ENV_ERROR and
# Outcome.ENV_ERROR, are equal strings): a session step converts its outcome, so lookups are dict reads.
_NUMBERS: dict[type[StrEnum], dict[StrEnum, int]] = {
    Setting: _pairs(Setting, types_pb2.Setting),
    FinishReason: _pairs(FinishReason, types_pb2.FinishReason),
    Outcome: _pairs(Outcome, types_pb2.Outcome),
}
_MEMBERS: dict[type[StrEnum], dict[int, StrEnum]] = {
    cls: {number: member for member, number in numbers.items()} for cls, numbers in _NUMBERS.items()
}


def to_wire(value: StrEnum) -> Any:
    """The proto enum number of ``value`` (a member of one of the shared enums)."""
    return _NUMBERS[type(value)][value]


def from_wire(cls: type[E], number: int, *, unknown: E | None = None) -> E:
    """The member of ``cls`` that proto enum ``number`` names.

    Args:
        cls: One of the shared enums (``Setting``, ``FinishReason``, ``Outcome``).
        number: The field's value as received.
        unknown: What a number this side does not know means (a newer peer's value); without it,
            such a number is an error. Zero ("not set") is always an error.

    Raises:
        ValueError: ``number`` is zero, or unknown and no ``unknown`` was given; the message names the
            enum and its values.
    """
    member = _MEMBERS[cls].get(number)
    if member is not None:
        return cast(E, member)
    choices = ", ".join(m.value for m in cls)
    if number == 0:
        raise ValueError(f"the message carries no {cls.__name__} ({_prefix(cls)}_UNSPECIFIED); set one of {choices}")
    if unknown is not None:
        return unknown
    raise ValueError(f"{cls.__name__} number {number} is none of {choices} (a peer newer than this code?)")
