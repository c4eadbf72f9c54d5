"""The memory's records through their wire messages: enums survive, bad values are the caller's error."""

from __future__ import annotations

import pytest

from spade.envs.types import FinishReason, Setting
from spade.memory import wire
from spade.memory.errors import InvalidArgument
from spade.memory.records import DesignerAttempt, Play
from spade.v1 import memory_pb2


def test_a_play_and_an_attempt_come_back_with_their_enums() -> None:
    play = Play("e-1", 7, True, 1.0, 3, 2, "t-1", finish_reason=FinishReason.FAULT_CPU)
    back = wire.play_from_pb(memory_pb2.PlayRecord.FromString(wire.play_to_pb(play).SerializeToString()))
    assert back.finish_reason is FinishReason.FAULT_CPU
    attempt = DesignerAttempt(sample_id="s-1", setting=Setting.TOOL, skill="Error Recovery", outcome="valid")
    assert wire.attempt_from_pb(wire.attempt_to_pb(attempt)).setting is Setting.TOOL


def test_bad_values_are_invalid_arguments_on_either_side() -> None:
    with pytest.raises(InvalidArgument, match="finish_reason 'exploded' is not one of"):
        wire.play_to_pb(Play("e-1", 7, True, 1.0, 3, 2, "t-1", finish_reason="exploded"))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="setting must be 'game' or 'tool', got 'board'"):
        wire.attempt_to_pb(DesignerAttempt(sample_id="s-1", setting="board", skill="s", outcome="valid"))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="setting: the message carries no Setting"):
        wire.attempt_from_pb(memory_pb2.DesignerAttempt(sample_id="s-1"))
