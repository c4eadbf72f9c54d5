"""The memory's aggregate statistics and the pool's process metrics, read from the database.

Every figure is defined in ``spade.signal`` or ``spade.pool_metrics``; this module only gathers
their inputs with SQL. What is costly per env is computed once and kept: reward levels and mean
turns in ``env_stats`` (when plays are recorded), program length in ``environments`` (when stored),
the sandbox probe in ``env_probes`` (when reported), the description's embedding in
``env_embeddings`` (the first time the Vendi metric covers the env). ``SqlStore.stats`` caches the
result until the database changes (a fingerprint of the last writes, so every replica sees it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, true
from sqlalchemy.orm import Session

from services.memory.store.models import (
    DesignerAttemptRow,
    EnvEmbeddingRow,
    EnvironmentRow,
    EnvProbeRow,
    EnvStatsRow,
    PlayRow,
    RunSpecRow,
)
from spade import pool_metrics, signal
from spade.envs.types import FinishReason
from spade.memory.records import ATTEMPT_VALID, AttemptStats, EnvStatus, MemoryStats, PoolMetrics
from spade.serving.logs import get_logger

log = get_logger(__name__)

POOL_STATUSES = (EnvStatus.VALID.value, EnvStatus.RETIRED.value)
"""Environments that passed validation and their audit: the pool the process metrics describe."""

ROUNDS_SHOWN = 50
"""How many of the most recent designer rounds ``AttemptStats.by_round`` lists."""


def fingerprint(s: Session) -> tuple[Any, ...]:
    """What changes whenever anything the statistics read changes (one cheap query per table)."""
    return (
        s.scalar(select(func.max(EnvironmentRow.seq))),
        s.scalar(select(func.max(PlayRow.seq))),
        s.scalar(select(func.max(DesignerAttemptRow.seq))),
        s.scalar(select(func.max(EnvStatsRow.updated_at))),
        s.scalar(select(func.max(EnvProbeRow.probed_at))),
        s.scalar(select(func.count()).select_from(EnvProbeRow)),
        s.scalar(select(func.max(RunSpecRow.set_at))),
    )


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def attempt_stats(s: Session, since: datetime | None = None) -> AttemptStats:
    """Every recorded designer attempt by outcome, and the most recent rounds' breakdowns.

    Args:
        s: A session on the memory's database.
        since: Count only the attempts made at or after this time (``spade cluster status``'s last N
            minutes); default: every attempt.
    """
    made = DesignerAttemptRow.created_at >= since if since is not None else true()
    by_outcome = {
        str(k): int(v)
        for k, v in s.execute(
            select(DesignerAttemptRow.outcome, func.count()).where(made).group_by(DesignerAttemptRow.outcome)
        ).all()
    }
    recent = [
        str(b)
        for b, _ in s.execute(
            select(DesignerAttemptRow.batch_id, func.max(DesignerAttemptRow.seq).label("last"))
            .where(made)
            .group_by(DesignerAttemptRow.batch_id)
            .order_by(func.max(DesignerAttemptRow.seq).desc())
            .limit(ROUNDS_SHOWN)
        ).all()
    ]
    by_round: dict[str, dict[str, int]] = {b: {} for b in recent}
    if recent:
        rows = s.execute(
            select(DesignerAttemptRow.batch_id, DesignerAttemptRow.outcome, func.count())
            .where(DesignerAttemptRow.batch_id.in_(recent), made)
            .group_by(DesignerAttemptRow.batch_id, DesignerAttemptRow.outcome)
        ).all()
        for batch, outcome, n in rows:
            by_round[str(batch)][str(outcome)] = int(n)
    attempts = sum(by_outcome.values())
    valid = by_outcome.get(ATTEMPT_VALID, 0)
    return AttemptStats(
        attempts=attempts,
        valid=valid,
        validity_rate=valid / attempts if attempts else None,
        by_outcome=by_outcome,
        by_round=by_round,
    )


def _vendi(s: Session, envs: list[tuple[str, str]], embedder: Any, model_name: str) -> tuple[float | None, str]:
    """Vendi score / n of ``envs`` (id, code), embedding each description once and keeping it."""
    if embedder is None:
        return None, "off: the memory is configured without the Vendi metric (vendi: false)"
    if not envs:
        return None, "no environment in the pool yet"
    import numpy as np

    probes = dict(
        s.execute(
            select(EnvProbeRow.env_id, EnvProbeRow.first_observation).where(
                EnvProbeRow.env_id.in_([i for i, _ in envs])
            )
        ).all()
    )
    descriptions = {i: pool_metrics.env_description(code, probes.get(i, "")) for i, code in envs}
    digests = {i: hashlib.sha256(d.encode("utf-8")).hexdigest() for i, d in descriptions.items()}
    cached = {
        row.env_id: row
        for row in s.scalars(select(EnvEmbeddingRow).where(EnvEmbeddingRow.env_id.in_(list(descriptions))))
    }
    missing = [
        i
        for i in descriptions
        if i not in cached or (cached[i].description_sha256, cached[i].model) != (digests[i], model_name)
    ]
    vectors: dict[str, Any] = {
        i: np.frombuffer(row.vector, dtype=np.float32).reshape(row.dim) for i, row in cached.items() if i not in missing
    }
    if missing:
        try:
            encoded = np.asarray(embedder.encode([descriptions[i] for i in missing]), dtype=np.float32)
        except Exception as exc:  # no model package, an unwritable cache, out of memory: the rest still counts
            log.warning("the Vendi metric's embeddings failed; /v1/stats shows the rest", exc_info=True)
            return None, f"unavailable: {type(exc).__name__}: {str(exc)[:300]}"
        for i, vector in zip(missing, encoded, strict=True):
            vectors[i] = vector
            row = cached.get(i) or EnvEmbeddingRow(env_id=i)
            row.description_sha256, row.model = digests[i], model_name
            row.dim, row.vector = int(vector.shape[0]), vector.astype(np.float32).tobytes()
            s.add(row)
    matrix = np.stack([vectors[i] for i, _ in envs])
    return pool_metrics.vendi_score(matrix) / len(envs), ""


def pool_stats(s: Session, window: int, embedder: Any, model_name: str) -> PoolMetrics:
    """The pool's process metrics (issue 11); ``s`` must be writable (new embeddings are kept)."""
    in_pool = EnvironmentRow.status.in_(POOL_STATUSES)
    # Hash-distinct envs (spade.pool_metrics.hash_distinct) are counted by the unique normalised-code
    # hash the store dedups on: every stored env is hash-distinct, so the count is the pool's size.
    envs, documents, lines, chars = s.execute(
        select(
            func.count(),
            func.count(func.distinct(func.nullif(EnvironmentRow.corpus_ref, ""))),
            func.avg(EnvironmentRow.program_lines),
            func.avg(EnvironmentRow.program_chars),
        ).where(in_pool)
    ).one()
    scored_rates = [
        float(w or 0.0)
        for (w,) in s.execute(
            select(EnvStatsRow.win_rate)
            .join(EnvironmentRow, EnvironmentRow.id == EnvStatsRow.env_id)
            .where(in_pool, EnvStatsRow.win_rate.is_not(None))
            .order_by(EnvironmentRow.seq)
        ).all()
    ]
    levels, turns = s.execute(
        select(func.avg(EnvStatsRow.reward_levels), func.avg(EnvStatsRow.turns_mean))
        .join(EnvironmentRow, EnvironmentRow.id == EnvStatsRow.env_id)
        .where(in_pool, EnvStatsRow.plays > 0)
    ).one()
    probed, hidden_size, hidden_bytes = s.execute(
        select(func.count(), func.avg(EnvProbeRow.hidden_state_size), func.avg(EnvProbeRow.hidden_state_bytes))
        .join(EnvironmentRow, EnvironmentRow.id == EnvProbeRow.env_id)
        .where(in_pool, EnvProbeRow.error == "")
    ).one()
    verdicts = [
        bool(v)
        for (v,) in s.execute(
            select(EnvProbeRow.leaked)
            .join(EnvironmentRow, EnvironmentRow.id == EnvProbeRow.env_id)
            .where(in_pool, EnvProbeRow.leaked.is_not(None))
        ).all()
    ]
    recent = [
        (str(i), str(c))
        for i, c in reversed(
            s.execute(
                select(EnvironmentRow.id, EnvironmentRow.code)
                .where(in_pool)
                .order_by(EnvironmentRow.seq.desc())
                .limit(window)
            ).all()
        )
    ]
    vendi, note = _vendi(s, recent, embedder, model_name)
    audit_retired = s.scalar(select(func.count()).where(EnvironmentRow.status == EnvStatus.TRIVIALLY_WON.value))
    return PoolMetrics(
        envs=int(envs or 0),
        scored=len(scored_rates),
        learnable_fraction=signal.learnable_fraction(scored_rates),
        learnable_fraction_window=signal.learnable_fraction(pool_metrics.windowed(scored_rates, window)),
        window=window,
        vendi_per_n=vendi,
        vendi_n=len(recent) if vendi is not None else 0,
        vendi_note=note,
        hash_distinct=int(envs or 0),
        distinct_documents=int(documents or 0),
        reward_levels_mean=float(levels) if levels is not None else None,
        interaction_turns_mean=float(turns) if turns is not None else None,
        program_lines_mean=float(lines) if lines is not None else None,
        program_chars_mean=float(chars) if chars is not None else None,
        probed=int(probed or 0),
        hidden_state_size_mean=float(hidden_size) if hidden_size is not None else None,
        hidden_state_bytes_mean=float(hidden_bytes) if hidden_bytes is not None else None,
        leakage_share=pool_metrics.leakage_share(verdicts),
        audit_retired=int(audit_retired or 0),
    )


def memory_stats(s: Session, window: int, embedder: Any, model_name: str) -> MemoryStats:
    """Everything ``GET /v1/stats`` shows."""
    by_status = {
        str(k): int(v)
        for k, v in s.execute(select(EnvironmentRow.status, func.count()).group_by(EnvironmentRow.status)).all()
    }
    by_skill = {
        str(k): int(v)
        for k, v in s.execute(select(EnvironmentRow.skill, func.count()).group_by(EnvironmentRow.skill)).all()
    }
    rates = [
        float(w or 0.0) for (w,) in s.execute(select(EnvStatsRow.win_rate).where(EnvStatsRow.win_rate.is_not(None)))
    ]
    mean_regret = s.scalar(select(func.avg(EnvStatsRow.regret)))
    finish = {
        str(k): int(v)
        for k, v in s.execute(select(PlayRow.finish_reason, func.count()).group_by(PlayRow.finish_reason)).all()
    }
    attempts = attempt_stats(s)
    spec_id = s.scalar(select(RunSpecRow.spec_id)) or ""
    return MemoryStats(
        total=sum(by_status.values()),
        by_status=by_status,
        by_skill=by_skill,
        scored=len(rates),
        learnable_fraction=signal.learnable_fraction(rates),
        mean_regret=float(mean_regret) if mean_regret is not None else None,
        validity_rate=attempts.validity_rate,
        plays=sum(finish.values()),
        resource_fault_plays=sum(n for k, n in finish.items() if FinishReason.names_resource_fault(k)),
        plays_by_finish_reason=finish,
        attempts=attempts,
        pool=pool_stats(s, window, embedder, model_name),
        spec_id=spec_id,
    )
