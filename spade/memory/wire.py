"""Translation between the memory's records and ``spade.v1.memory_pb2`` messages (both directions).

The gRPC servicer (``services.memory.grpc_server``) and ``spade.memory.client.MemoryClient`` share
it, so a record survives a round trip unchanged; both ends use its ``GRPC_OPTIONS``.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from spade.envs.types import FinishReason, Setting
from spade.memory.errors import InvalidArgument
from spade.memory.records import (
    DesignerAttempt,
    EnvFilter,
    Environment,
    EnvProbe,
    EnvStats,
    EnvStatus,
    Example,
    Examples,
    NewEnvironment,
    Play,
    RunSpecRecord,
    StatsUpdate,
)
from spade.v1 import memory_pb2 as pb
from spade.wire_enums import from_wire, to_wire

GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
"""Channel and server options of both ends: listings with code can be large (1000 environments of tens of KiB)."""


def _ms(t: datetime) -> int:
    return int(t.timestamp() * 1000)


def _from_ms(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def setting(number: int) -> Setting:
    """The ``Setting`` a message carries.

    Raises:
        InvalidArgument: None set, or a number this side does not know.
    """
    try:
        return from_wire(Setting, number)
    except ValueError as exc:
        raise InvalidArgument(f"setting: {exc}") from None


def setting_number(value: str) -> Any:
    """A record's setting as its wire number.

    Raises:
        InvalidArgument: Neither game nor tool (refused before it is sent, as the server would).
    """
    try:
        return to_wire(Setting.parse(value))
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def _finish_reason_in(number: int) -> FinishReason | None:
    """A play's finish reason from the wire: None when none was set (a play recorded without one)."""
    try:
        return from_wire(FinishReason, number) if number else None
    except ValueError as exc:
        raise InvalidArgument(f"finish_reason: {exc}") from None


def _finish_reason_out(value: str | None) -> Any:
    """A play's finish reason as its wire number (0 when the play names none).

    Raises:
        InvalidArgument: Not a ``FinishReason`` value (refused before it is sent).
    """
    try:
        return to_wire(FinishReason(value)) if value else 0
    except ValueError:
        raise InvalidArgument(f"finish_reason {value!r} is not one of {[r.value for r in FinishReason]}") from None


def status(value: str, *, default: EnvStatus | None = None) -> EnvStatus | None:
    """Parse a status string; empty gives ``default``.

    Raises:
        InvalidArgument: Not one of the statuses.
    """
    if not value:
        return default
    try:
        return EnvStatus(value)
    except ValueError:
        raise InvalidArgument(f"status {value!r} is not one of {[s.value for s in EnvStatus]}") from None


def new_env_from_pb(m: pb.NewEnvironment) -> NewEnvironment:
    """Raises ``InvalidArgument`` for a report that is not a JSON object or an unknown status."""
    try:
        report = json.loads(m.validation_report_json) if m.validation_report_json else {}
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"validation_report_json is not valid JSON ({exc.msg} at {exc.pos})") from None
    if not isinstance(report, dict):
        raise InvalidArgument("validation_report_json must be a JSON object")
    return NewEnvironment(
        setting=setting(m.setting),
        skill=m.skill,
        code=m.code,
        hint=m.hint,
        validation_report=report,
        status=status(m.status, default=EnvStatus.VALID) or EnvStatus.VALID,
        weight_version=m.weight_version,
        designer_sample_id=m.designer_sample_id,
        env_class=m.env_class,
        corpus_ref=m.corpus_ref,
        batch_id=m.batch_id,
        parent_ids=tuple(m.parent_ids),
    )


def new_env_to_pb(e: NewEnvironment) -> pb.NewEnvironment:
    return pb.NewEnvironment(
        setting=setting_number(e.setting),
        skill=e.skill,
        code=e.code,
        hint=e.hint,
        validation_report_json=json.dumps(e.validation_report),
        status=EnvStatus(e.status).value,
        weight_version=e.weight_version,
        designer_sample_id=e.designer_sample_id,
        env_class=e.env_class,
        corpus_ref=e.corpus_ref,
        batch_id=e.batch_id,
        parent_ids=list(e.parent_ids),
    )


def stats_to_pb(s: EnvStats) -> pb.EnvStats:
    m = pb.EnvStats(
        plays=s.plays,
        window_plays=s.window_plays,
        learnable=s.learnable,
        reward_components=s.reward_components,
        regret_note=s.regret_note,
    )
    if s.win_rate is not None:
        m.win_rate = s.win_rate
    if s.regret is not None:
        m.regret = s.regret
    if s.solved_fraction is not None:
        m.solved_fraction = s.solved_fraction
    return m


def stats_from_pb(m: pb.EnvStats) -> EnvStats:
    return EnvStats(
        plays=m.plays,
        window_plays=m.window_plays,
        win_rate=m.win_rate if m.HasField("win_rate") else None,
        regret=m.regret if m.HasField("regret") else None,
        learnable=m.learnable,
        reward_components=dict(m.reward_components),
        solved_fraction=m.solved_fraction if m.HasField("solved_fraction") else None,
        regret_note=m.regret_note,
    )


def env_to_pb(e: Environment, *, include_code: bool = True) -> pb.StoredEnvironment:
    m = pb.StoredEnvironment(
        id=e.id,
        setting=setting_number(e.setting),
        skill=e.skill,
        code=e.code if include_code else "",
        code_hash=e.code_hash,
        hint=e.hint,
        validation_report_json=json.dumps(e.validation_report),
        status=e.status.value,
        weight_version=e.weight_version,
        designer_sample_id=e.designer_sample_id,
        env_class=e.env_class,
        corpus_ref=e.corpus_ref,
        batch_id=e.batch_id,
        parent_ids=list(e.parent_ids),
        created_at_ms=_ms(e.created_at),
        stats=stats_to_pb(e.stats),
        window_versions=e.window_versions,
    )
    if e.window_start is not None:
        m.window_start = e.window_start
    return m


def env_from_pb(m: pb.StoredEnvironment) -> Environment:
    return Environment(
        id=m.id,
        seq=0,  # keyset positions stay server-side; cursors carry them
        setting=setting(m.setting),
        skill=m.skill,
        code=m.code,
        code_hash=m.code_hash,
        hint=m.hint,
        validation_report=json.loads(m.validation_report_json or "{}"),
        status=EnvStatus(m.status),
        weight_version=m.weight_version,
        designer_sample_id=m.designer_sample_id,
        env_class=m.env_class,
        corpus_ref=m.corpus_ref,
        batch_id=m.batch_id,
        parent_ids=tuple(m.parent_ids),
        created_at=_from_ms(m.created_at_ms),
        stats=stats_from_pb(m.stats),
        window_start=m.window_start if m.HasField("window_start") else None,
        window_versions=m.window_versions,
    )


def filter_from_pb(m: pb.ListEnvironmentsRequest) -> EnvFilter:
    return EnvFilter(
        setting=setting(m.setting) if m.HasField("setting") else None,
        skill=m.skill if m.HasField("skill") else None,
        status=status(m.status) if m.HasField("status") else None,
        min_regret=m.min_regret if m.HasField("min_regret") else None,
        max_win_rate=m.max_win_rate if m.HasField("max_win_rate") else None,
        q=m.q if m.HasField("q") else None,
    )


def filter_to_pb(f: EnvFilter) -> pb.ListEnvironmentsRequest:
    m = pb.ListEnvironmentsRequest()
    if f.setting is not None:
        m.setting = setting_number(f.setting)
    for name in ("skill", "min_regret", "max_win_rate", "q"):
        value = getattr(f, name)
        if value is not None:
            setattr(m, name, value)
    if f.status is not None:
        m.status = EnvStatus(f.status).value
    return m


def play_from_pb(m: pb.PlayRecord) -> Play:
    return Play(
        env_id=m.env_id,
        seed=m.seed,
        hinted=m.hinted,
        episode_return=m.episode_return,
        turns=m.turns,
        weight_version=m.weight_version,
        trajectory_id=m.trajectory_id,
        finish_reason=_finish_reason_in(m.finish_reason),
        played_at=_from_ms(m.played_at_ms) if m.played_at_ms else None,
        window_start=m.window_start,
        window_index=m.window_index,
        spec_id=m.spec_id,
    )


def play_to_pb(p: Play) -> pb.PlayRecord:
    return pb.PlayRecord(
        env_id=p.env_id,
        seed=p.seed,
        hinted=p.hinted,
        episode_return=p.episode_return,
        turns=p.turns,
        weight_version=p.weight_version,
        trajectory_id=p.trajectory_id,
        finish_reason=_finish_reason_out(p.finish_reason),
        played_at_ms=_ms(p.played_at) if p.played_at else 0,
        window_start=p.window_start,
        window_index=p.window_index,
        spec_id=p.spec_id,
    )


def attempt_from_pb(m: pb.DesignerAttempt) -> DesignerAttempt:
    return DesignerAttempt(
        sample_id=m.sample_id,
        setting=setting(m.setting),
        skill=m.skill,
        outcome=m.outcome,
        batch_id=m.batch_id,
        weight_version=m.weight_version,
        env_id=m.env_id,
        spec_id=m.spec_id,
        created_at=_from_ms(m.created_at_ms) if m.created_at_ms else None,
    )


def attempt_to_pb(a: DesignerAttempt) -> pb.DesignerAttempt:
    return pb.DesignerAttempt(
        sample_id=a.sample_id,
        setting=setting_number(a.setting),
        skill=a.skill,
        outcome=a.outcome,
        batch_id=a.batch_id,
        weight_version=a.weight_version,
        env_id=a.env_id,
        spec_id=a.spec_id,
        created_at_ms=_ms(a.created_at) if a.created_at else 0,
    )


def runspec_to_pb(r: RunSpecRecord) -> pb.RunSpecRecord:
    return pb.RunSpecRecord(spec_id=r.spec_id, spec_json=r.spec_json, set_at_ms=_ms(r.set_at))


def runspec_from_pb(m: pb.RunSpecRecord) -> RunSpecRecord:
    return RunSpecRecord(spec_id=m.spec_id, spec_json=m.spec_json, set_at=_from_ms(m.set_at_ms))


def update_from_pb(m: pb.UpdateStatsRequest) -> StatsUpdate:
    return StatsUpdate(
        reward_components=dict(m.reward_components),
        learnable=m.learnable if m.HasField("learnable") else None,
        status=status(m.status),
    )


def update_to_pb(env_id: str, u: StatsUpdate) -> pb.UpdateStatsRequest:
    m = pb.UpdateStatsRequest(env_id=env_id, reward_components=u.reward_components)
    if u.learnable is not None:
        m.learnable = u.learnable
    if u.status is not None:
        m.status = EnvStatus(u.status).value
    return m


def example_to_pb(e: Example) -> pb.MemoryExample:
    m = pb.MemoryExample(env_id=e.env_id, skill=e.skill, code=e.code, reason=e.reason, win_rate=e.win_rate)
    if e.regret is not None:
        m.regret = e.regret
    return m


def example_from_pb(m: pb.MemoryExample) -> Example:
    return Example(
        env_id=m.env_id,
        skill=m.skill,
        code=m.code,
        reason=m.reason,
        win_rate=m.win_rate,
        regret=m.regret if m.HasField("regret") else None,
    )


def examples_to_pb(ex: Examples) -> pb.SampleExamplesResponse:
    return pb.SampleExamplesResponse(
        positives=[example_to_pb(e) for e in ex.positives], negatives=[example_to_pb(e) for e in ex.negatives]
    )


def examples_from_pb(m: pb.SampleExamplesResponse) -> Examples:
    return Examples(
        positives=tuple(example_from_pb(e) for e in m.positives),
        negatives=tuple(example_from_pb(e) for e in m.negatives),
    )


def probe_to_pb(p: EnvProbe) -> pb.RecordProbeRequest:
    return pb.RecordProbeRequest(
        env_id=p.env_id,
        first_observation=p.first_observation,
        hidden_attributes=p.hidden_attributes,
        solution=list(p.solution),
        error=p.error,
    )


def probe_from_pb(m: pb.RecordProbeRequest) -> EnvProbe:
    return EnvProbe(
        env_id=m.env_id,
        first_observation=m.first_observation,
        hidden_attributes=dict(m.hidden_attributes),
        solution=tuple(m.solution),
        error=m.error,
    )
