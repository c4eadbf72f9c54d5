"""Initial schema: environments, their statistics, and plays.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

SEQ = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "environments",
        sa.Column("seq", SEQ, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("setting", sa.String(16), nullable=False),
        sa.Column("skill", sa.String(100), nullable=False),
        sa.Column("code", sa.Text(), nullable=False),
        sa.Column("code_hash", sa.String(64), nullable=False),
        sa.Column("hint", sa.Text(), nullable=False),
        sa.Column("env_class", sa.String(200), nullable=False),
        sa.Column("corpus_ref", sa.String(1000), nullable=False),
        sa.Column("validation_report", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("weight_version", sa.BigInteger(), nullable=False),
        sa.Column("designer_sample_id", sa.String(200), nullable=False),
        sa.Column("batch_id", sa.String(200), nullable=False),
        sa.Column("parent_ids", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("seq", name="pk_environments"),
        sa.UniqueConstraint("id", name="uq_environments_id"),
        sa.UniqueConstraint("code_hash", name="uq_environments_code_hash"),
    )
    op.create_index("ix_environments_setting_skill_seq", "environments", ["setting", "skill", "seq"])
    op.create_index("ix_environments_status_seq", "environments", ["status", "seq"])
    op.create_table(
        "env_stats",
        sa.Column("env_id", sa.String(64), nullable=False),
        sa.Column("plays", sa.Integer(), nullable=False),
        sa.Column("window_plays", sa.Integer(), nullable=False),
        sa.Column("win_rate", sa.Float(), nullable=True),
        sa.Column("regret", sa.Float(), nullable=True),
        sa.Column("learnable", sa.Boolean(), nullable=False),
        sa.Column("reward_components", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("env_id", name="pk_env_stats"),
        sa.ForeignKeyConstraint(
            ["env_id"], ["environments.id"], name="fk_env_stats_env_id_environments", ondelete="CASCADE"
        ),
    )
    op.create_table(
        "plays",
        sa.Column("seq", SEQ, primary_key=True, autoincrement=True),
        sa.Column("env_id", sa.String(64), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("hinted", sa.Boolean(), nullable=False),
        sa.Column("episode_return", sa.Float(), nullable=False),
        sa.Column("turns", sa.Integer(), nullable=False),
        sa.Column("weight_version", sa.BigInteger(), nullable=False),
        sa.Column("trajectory_id", sa.String(200), nullable=False),
        sa.Column("finish_reason", sa.String(32), nullable=False),
        sa.Column("played_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("seq", name="pk_plays"),
        sa.UniqueConstraint("trajectory_id", name="uq_plays_trajectory_id"),
        sa.ForeignKeyConstraint(
            ["env_id"], ["environments.id"], name="fk_plays_env_id_environments", ondelete="CASCADE"
        ),
    )
    op.create_index("ix_plays_env_id_seq", "plays", ["env_id", "seq"])


def downgrade() -> None:
    op.drop_index("ix_plays_env_id_seq", table_name="plays")
    op.drop_table("plays")
    op.drop_table("env_stats")
    op.drop_index("ix_environments_status_seq", table_name="environments")
    op.drop_index("ix_environments_setting_skill_seq", table_name="environments")
    op.drop_table("environments")
