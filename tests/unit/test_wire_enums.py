"""The domain's enums on the wire (spade/wire_enums.py): the protos and spade.envs.types stay in step."""

from __future__ import annotations

from enum import StrEnum

import pytest

from spade.envs.types import FinishReason, Outcome, Setting
from spade.v1 import queues_pb2, types_pb2
from spade.wire_enums import from_wire, to_wire

SHARED: list[tuple[type[StrEnum], object]] = [
    (Setting, types_pb2.Setting),
    (FinishReason, types_pb2.FinishReason),
    (Outcome, types_pb2.Outcome),
]


@pytest.mark.parametrize(("cls", "wire"), SHARED, ids=lambda v: getattr(v, "__name__", ""))
def test_every_member_has_its_proto_value_and_every_proto_value_its_member(cls: type[StrEnum], wire: object) -> None:
    numbers = {to_wire(member) for member in cls}
    assert len(numbers) == len(cls) and 0 not in numbers  # one distinct, set number per member
    assert [from_wire(cls, to_wire(member)) for member in cls] == list(cls)
    proto_numbers = set(wire.values()) - {0}  # type: ignore[attr-defined]
    assert proto_numbers == numbers, "a proto value without a Python member (or the reverse): add it to both"


def test_a_round_trip_through_a_serialised_message_keeps_the_member() -> None:
    sent = queues_pb2.AgentSample(setting=to_wire(Setting.TOOL), finish_reason=to_wire(FinishReason.FAULT_CPU))
    got = queues_pb2.AgentSample.FromString(sent.SerializeToString())
    assert from_wire(Setting, got.setting) is Setting.TOOL
    assert from_wire(FinishReason, got.finish_reason) is FinishReason.FAULT_CPU


def test_an_unset_or_unknown_number_is_refused_by_name_unless_a_meaning_is_given() -> None:
    with pytest.raises(ValueError, match=r"carries no FinishReason .*terminated"):
        from_wire(FinishReason, 0)
    with pytest.raises(ValueError, match="Outcome number 99 is none of ok, env_error"):
        from_wire(Outcome, 99)
    assert from_wire(Outcome, 99, unknown=Outcome.SANDBOX_FAULT) is Outcome.SANDBOX_FAULT
