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

    __table_args__ = (Index("ix_plays_env_id_seq", "env_id", "seq"),)
