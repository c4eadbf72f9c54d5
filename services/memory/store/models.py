"""SQLAlchemy table definitions. The Alembic migrations in ``services/memory/migrations`` create them;
``tests/integration/memory`` checks that the migrated schema matches these models."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# SQLite only auto-increments INTEGER PRIMARY KEY columns.
SeqType = BigInteger().with_variant(Integer, "sqlite")

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class EnvironmentRow(Base):
    __tablename__ = "environments"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    setting: Mapped[str] = mapped_column(String(16))
    skill: Mapped[str] = mapped_column(String(100))
    code: Mapped[str] = mapped_column(Text)
    code_hash: Mapped[str] = mapped_column(String(64), unique=True)
    hint: Mapped[str] = mapped_column(Text, default="")
    env_class: Mapped[str] = mapped_column(String(200), default="")
    corpus_ref: Mapped[str] = mapped_column(String(1000), default="")
    validation_report: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    status: Mapped[str] = mapped_column(String(16))
    weight_version: Mapped[int] = mapped_column(BigInteger, default=0)
    designer_sample_id: Mapped[str] = mapped_column(String(200), default="")
    batch_id: Mapped[str] = mapped_column(String(200), default="")
    parent_ids: Mapped[list[str]] = mapped_column(JSON, default=list)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # The env's own window (WAVE2 §3): NULL until the first set_window, which nothing overwrites.
    window_start: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    window_versions: Mapped[int] = mapped_column(Integer, default=0)
    program_lines: Mapped[int] = mapped_column(Integer, default=0)
    program_chars: Mapped[int] = mapped_column(Integer, default=0)

    __table_args__ = (
        Index("ix_environments_setting_skill_seq", "setting", "skill", "seq"),
        Index("ix_environments_status_seq", "status", "seq"),
    )


class EnvStatsRow(Base):
    __tablename__ = "env_stats"

    env_id: Mapped[str] = mapped_column(String(64), ForeignKey("environments.id", ondelete="CASCADE"), primary_key=True)
    plays: Mapped[int] = mapped_column(Integer, default=0)
    window_plays: Mapped[int] = mapped_column(Integer, default=0)
    win_rate: Mapped[float | None] = mapped_column(Float, nullable=True)
    regret: Mapped[float | None] = mapped_column(Float, nullable=True)
    learnable: Mapped[bool] = mapped_column(Boolean, default=False)
    reward_components: Mapped[dict[str, float]] = mapped_column(JSON, default=dict)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    solved_fraction: Mapped[float | None] = mapped_column(Float, nullable=True)
    regret_note: Mapped[str] = mapped_column(Text, default="")
    reward_levels: Mapped[int] = mapped_column(Integer, default=0)
    turns_mean: Mapped[float | None] = mapped_column(Float, nullable=True)

    # The statistics cache's fingerprint reads max(updated_at).
    __table_args__ = (Index("ix_env_stats_updated_at", "updated_at"),)


class PlayRow(Base):
    __tablename__ = "plays"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    env_id: Mapped[str] = mapped_column(String(64), ForeignKey("environments.id", ondelete="CASCADE"))
    seed: Mapped[int] = mapped_column(BigInteger)
    hinted: Mapped[bool] = mapped_column(Boolean)
    episode_return: Mapped[float] = mapped_column(Float)
    turns: Mapped[int] = mapped_column(Integer)
    weight_version: Mapped[int] = mapped_column(BigInteger)
    trajectory_id: Mapped[str] = mapped_column(String(200), unique=True)
    finish_reason: Mapped[str] = mapped_column(String(32), default="")
    played_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    window_start: Mapped[int] = mapped_column(BigInteger, default=0)
    window_index: Mapped[int] = mapped_column(Integer, default=0)
    spec_id: Mapped[str] = mapped_column(String(64), default="")

    __table_args__ = (Index("ix_plays_env_id_seq", "env_id", "seq"),)


class DesignerAttemptRow(Base):
    """Every designer attempt, valid or not (validity figures count malformed answers)."""

    __tablename__ = "designer_attempts"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    sample_id: Mapped[str] = mapped_column(String(200), unique=True)
    setting: Mapped[str] = mapped_column(String(16))
    skill: Mapped[str] = mapped_column(String(100))
    batch_id: Mapped[str] = mapped_column(String(200), default="")
    weight_version: Mapped[int] = mapped_column(BigInteger, default=0)
    outcome: Mapped[str] = mapped_column(String(100))
    env_id: Mapped[str] = mapped_column(String(64), default="")
    spec_id: Mapped[str] = mapped_column(String(64), default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

    __table_args__ = (Index("ix_designer_attempts_batch_id_seq", "batch_id", "seq"),)


class RunSpecRow(Base):
    """The one current run spec (``slot`` is always 1, so two writers race on one primary key)."""

    __tablename__ = "run_spec"

    slot: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    spec_id: Mapped[str] = mapped_column(String(64))
    spec_json: Mapped[str] = mapped_column(Text)
    set_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class EnvProbeRow(Base):
    """What one sandboxed reset of an env showed (first observation, hidden state, leakage verdict)."""

    __tablename__ = "env_probes"

    env_id: Mapped[str] = mapped_column(String(64), ForeignKey("environments.id", ondelete="CASCADE"), primary_key=True)
    first_observation: Mapped[str] = mapped_column(Text, default="")
    hidden_attributes: Mapped[dict[str, int]] = mapped_column(JSON, default=dict)
    solution: Mapped[list[str]] = mapped_column(JSON, default=list)
    error: Mapped[str] = mapped_column(Text, default="")
    hidden_state_size: Mapped[int] = mapped_column(Integer, default=0)
    hidden_state_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    leaked: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    leak_rule: Mapped[str] = mapped_column(String(32), default="")
    probed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class EnvEmbeddingRow(Base):
    """An env description's sentence embedding, computed once (the Vendi metric reads it)."""

    __tablename__ = "env_embeddings"

    env_id: Mapped[str] = mapped_column(String(64), ForeignKey("environments.id", ondelete="CASCADE"), primary_key=True)
    description_sha256: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(100))
    dim: Mapped[int] = mapped_column(Integer)
    vector: Mapped[bytes] = mapped_column(LargeBinary)


class WebSessionRow(Base):
    """A web page login: the cookie holds a random session id, the table only its SHA-256."""

    __tablename__ = "web_sessions"

    id_sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
